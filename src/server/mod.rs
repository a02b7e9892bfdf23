//! `lily serve`: an OpenAI-compatible HTTP server (axum on tokio) in front of the engine.
//!
//! This module owns start-up and shutdown ([`run`]): the served model ([`ServedModel`], from a
//! checkpoint directory or the embedded demo), the engine thread, the listener, logging, and the
//! graceful shutdown on SIGINT/SIGTERM. It also builds the [`router`]: `/v1/chat/completions`
//! ([`chat`]), `/v1/completions` ([`completions`]), `/v1/responses` ([`responses`]), `/v1/models`,
//! vLLM's `/tokenize` and `/detokenize` ([`tokenize`]), `/health` and `/metrics` ([`metrics`]),
//! with the API key check (all but the last two) and the body size limit.
//! Streams are assembled in [`stream`]; replies are split into reasoning ([`reasoning`]) and tool
//! calls ([`tool_calls`]).

pub mod chat;
pub mod completions;
pub mod errors;
pub mod generation;
pub mod metrics;
pub mod openai;
pub mod reasoning;
pub mod responses;
pub mod stream;
pub mod tokenize;
pub mod tool_calls;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use axum::extract::rejection::PathRejection;
use axum::extract::{DefaultBodyLimit, Path as UrlPath, Request, State};
use axum::http::{Method, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};

use self::errors::ApiError;
use self::openai::{ModelCard, ModelList};
use crate::backend::Backend;
use crate::config::eos_token_ids;
use crate::engine::constraint::Grammars;
use crate::engine::scheduler::{Engine, EngineHandle, EngineOptions};
use crate::model::Model;
use crate::model::demo::{DEMO_MODEL_NAME, demo};
use crate::text::chat_template::ChatTemplate;
use crate::text::tokenizer::Tokenizer;

/// What `lily serve` is asked to do.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub host: String,
    pub port: u16,
    pub api_key: Option<String>,
    /// Sequences generated at once.
    pub max_batch: usize,
    /// `max_batch` is the default, not asked for: a backend with a fixed pool of sequence states
    /// (CUDA) may take fewer where memory is short, instead of refusing to start.
    pub fit_max_batch: bool,
    /// Requests that may wait for a free sequence slot before new ones get 429.
    pub max_queue: usize,
    /// Longest sequence (prompt + completion); capped by the model's own limit.
    pub context: usize,
    /// Prompt tokens prefilled per engine step.
    pub prefill_chunk: usize,
    /// Sequence states kept for prompts that start the same way (0: none).
    pub prefix_cache: usize,
    pub max_body_bytes: usize,
    /// How long a shutdown waits for running requests before cancelling them.
    pub shutdown_grace: Duration,
}

/// Sampling settings a request gets for the fields it leaves out: the checkpoint's
/// `generation_config.json` where it has them (as vLLM does), else OpenAI's defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub min_p: f32,
    pub repetition_penalty: f32,
}

impl Default for SamplingDefaults {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

impl SamplingDefaults {
    /// Reads `generation_config.json` in `dir` (defaults where it or a field is missing).
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("generation_config.json");
        let Ok(text) = std::fs::read_to_string(&path) else {
            return Ok(Self::default());
        };
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        let number = |key: &str| v.get(key).and_then(Value::as_f64).map(|x| x as f32);
        let mut defaults = Self::default();
        if v.get("do_sample").and_then(Value::as_bool) == Some(false) {
            defaults.temperature = 0.0;
        } else if let Some(t) = number("temperature") {
            defaults.temperature = t;
        }
        defaults.top_p = number("top_p").unwrap_or(defaults.top_p);
        defaults.top_k = v
            .get("top_k")
            .and_then(Value::as_u64)
            .map_or(defaults.top_k, |k| k as usize);
        defaults.min_p = number("min_p").unwrap_or(defaults.min_p);
        defaults.repetition_penalty =
            number("repetition_penalty").unwrap_or(defaults.repetition_penalty);
        Ok(defaults)
    }
}

/// The model as the HTTP side sees it: names, text processing and generation settings.
pub struct ServedModel {
    /// The name clients use (`model` field); the first is the one listed.
    pub names: Vec<String>,
    pub is_demo: bool,
    /// Without one, only `/v1/completions` with token-id prompts works.
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub chat_template: Option<Arc<ChatTemplate>>,
    pub eos_token_ids: Vec<u32>,
    pub sampling_defaults: SamplingDefaults,
    /// The model's own context limit (`max_position_embeddings`).
    pub max_position_embeddings: usize,
}

impl ServedModel {
    /// Loads a checkpoint directory: the model and what the server needs beside it.
    pub fn load(dir: &Path) -> Result<(Arc<Model>, Self)> {
        let model = Arc::new(Model::load(dir)?);
        let tokenizer = if dir.join("tokenizer.json").exists() {
            Some(Arc::new(Tokenizer::from_model_dir(dir)?))
        } else {
            tracing::warn!(
                "{} has no tokenizer.json: only /v1/completions with token-id prompts will work",
                dir.display()
            );
            None
        };
        let chat_template = match &tokenizer {
            Some(_) => Some(Arc::new(ChatTemplate::from_model_dir(dir)?)),
            None => None,
        };
        let mut names = Vec::new();
        if let Some(base) = dir.file_name().and_then(|n| n.to_str()) {
            names.push(base.to_owned());
        }
        names.push(dir.display().to_string());
        let served = Self {
            names,
            is_demo: false,
            tokenizer,
            chat_template,
            eos_token_ids: eos_token_ids(dir, &model.config)?,
            sampling_defaults: SamplingDefaults::from_model_dir(dir)?,
            max_position_embeddings: model.config.max_position_embeddings,
        };
        Ok((model, served))
    }

    /// The embedded demo model.
    pub fn demo() -> Result<(Arc<Model>, Self)> {
        let demo = demo()?;
        let served = Self {
            names: vec![DEMO_MODEL_NAME.to_owned()],
            is_demo: true,
            tokenizer: Some(Arc::new(demo.tokenizer)),
            chat_template: Some(Arc::new(demo.chat_template)),
            eos_token_ids: demo.eos_token_ids,
            sampling_defaults: SamplingDefaults::default(),
            max_position_embeddings: demo.model.config.max_position_embeddings,
        };
        Ok((Arc::new(demo.model), served))
    }

    pub fn name(&self) -> &str {
        &self.names[0]
    }
}

/// What every handler shares.
pub struct AppState {
    pub engine: EngineHandle,
    pub model: ServedModel,
    /// Longest sequence a request may make (prompt + completion).
    pub context: usize,
    pub api_key: Option<String>,
    pub http_metrics: metrics::HttpMetrics,
    /// When the server started (Unix seconds), for `/v1/models`.
    pub started: u64,
    /// Structured output's parser for the tokenizer, built on first use (a trie of every token).
    grammars: std::sync::OnceLock<Result<Arc<Grammars>, String>>,
}

impl AppState {
    pub fn new(
        engine: EngineHandle,
        model: ServedModel,
        context: usize,
        api_key: Option<String>,
    ) -> Self {
        Self {
            engine,
            context: context.min(model.max_position_embeddings),
            model,
            api_key,
            http_metrics: metrics::HttpMetrics::default(),
            started: unix_now(),
            grammars: std::sync::OnceLock::new(),
        }
    }

    /// The structured-output parser for the served tokenizer (blocking: the first call builds
    /// it). Replies end with `<|im_end|>`, else the model's first end-of-sequence id.
    pub fn grammars(&self) -> Result<Arc<Grammars>, String> {
        self.grammars
            .get_or_init(|| {
                let tokenizer = self
                    .model
                    .tokenizer
                    .clone()
                    .ok_or("this model has no tokenizer")?;
                let eos = tokenizer
                    .token_id("<|im_end|>")
                    .or(self.model.eos_token_ids.first().copied())
                    .ok_or("this model has no end-of-sequence token")?;
                Grammars::new(tokenizer, eos)
                    .map(Arc::new)
                    .map_err(|e| format!("{e:#}"))
            })
            .clone()
    }

    pub fn model_names(&self) -> impl Iterator<Item = &str> {
        self.model.names.iter().map(String::as_str)
    }

    /// A request's `model`, if given, must be one of the names the model is served under.
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if !self.model_names().any(|name| name == m) => {
                Err(ApiError::model_not_found(m))
            }
            _ => Ok(()),
        }
    }
}

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The HTTP routes, with the API key check on `/v1/*`, `/tokenize` and `/detokenize`, and the
/// body size limit.
pub fn router(app: Arc<AppState>, max_body_bytes: usize) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*id}", get(get_model))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route_layer(middleware::from_fn_with_state(app.clone(), require_api_key));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics::render))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(middleware::from_fn_with_state(
            app.clone(),
            metrics::count_requests,
        ))
        .with_state(app)
}

async fn require_api_key(
    State(app): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(expected) = &app.api_key else {
        return next.run(request).await;
    };
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        None => ApiError::unauthorized(
            "Missing API key: send it in an `Authorization: Bearer KEY` header.",
        )
        .into_response(),
        Some(key) if constant_time_eq(key.trim().as_bytes(), expected.as_bytes()) => {
            next.run(request).await
        }
        Some(_) => ApiError::unauthorized("Incorrect API key provided.").into_response(),
    }
}

/// Compares secrets without an early exit that would time how much of the key matched.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(uri.path())
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::method_not_allowed(method.as_str(), uri.path())
}

/// 200 while serving, 503 once shutdown began (so load balancers stop sending requests).
async fn health(State(app): State<Arc<AppState>>) -> Response {
    let m = app.engine.metrics();
    let accepting = app.engine.is_accepting();
    let body = Json(json!({
        "status": if accepting { "ok" } else { "shutting_down" },
        "model": app.model.name(),
        "running": m.running.load(std::sync::atomic::Ordering::Relaxed),
        "waiting": m.waiting.load(std::sync::atomic::Ordering::Relaxed),
    }));
    let status = if accepting {
        axum::http::StatusCode::OK
    } else {
        axum::http::StatusCode::SERVICE_UNAVAILABLE
    };
    (status, body).into_response()
}

fn model_card(app: &AppState) -> ModelCard {
    ModelCard {
        id: app.model.name().to_owned(),
        object: "model",
        created: app.started,
        owned_by: if app.model.is_demo {
            "lily (embedded demo model with random weights)"
        } else {
            "lily"
        },
        max_model_len: app.context,
    }
}

async fn list_models(State(app): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![model_card(&app)],
    })
}

async fn get_model(
    State(app): State<Arc<AppState>>,
    id: Result<UrlPath<String>, PathRejection>,
) -> Result<Json<ModelCard>, ApiError> {
    let UrlPath(id) = id.map_err(|e| ApiError::invalid("model", e.body_text()))?;
    app.check_model(Some(&id))?;
    Ok(Json(model_card(&app)))
}

/// Reads every page of a memory-mapped checkpoint before serving, with a progress bar, so the
/// first requests on the CPU backend do not wait for the disk. Small models are read silently.
pub fn page_in_weights(model: &Model) {
    const SHOW_FROM_BYTES: u64 = 256 << 20;
    let matrices = model.matrices();
    let total: u64 = matrices.iter().map(|m| m.stored_bytes() as u64).sum();
    let bar = if total >= SHOW_FROM_BYTES {
        tracing::info!("reading {:.1} GB of weights", total as f64 / 1e9);
        indicatif::ProgressBar::new(total)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "loading weights {bar:40} {binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec}, {eta})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let start = std::time::Instant::now();
    for matrix in matrices {
        bar.inc(matrix.page_in() as u64);
    }
    bar.finish_and_clear();
    if total >= SHOW_FROM_BYTES {
        tracing::info!("weights read in {:.1} s", start.elapsed().as_secs_f64());
    }
}

/// Serves `model` until SIGINT or SIGTERM. The backend is built on the engine thread by
/// `make_backend`. Logs the address it listens on (`listening on http://ADDR`).
pub fn run<B, F>(model: ServedModel, make_backend: F, options: ServeOptions) -> Result<()>
where
    B: Backend,
    F: FnOnce() -> Result<B> + Send + 'static,
{
    let engine = Engine::start(
        make_backend,
        model.tokenizer.clone(),
        EngineOptions {
            max_batch: options.max_batch,
            max_queue: options.max_queue,
            prefill_chunk: options.prefill_chunk,
            prefix_cache: options.prefix_cache,
        },
    )?;
    let app = Arc::new(AppState::new(
        engine.handle(),
        model,
        options.context,
        options.api_key.clone(),
    ));
    if app.model.is_demo {
        tracing::warn!(
            "serving the embedded demo model `{DEMO_MODEL_NAME}`: random weights, so replies are \
             random text (pass --model DIR to serve a real checkpoint)"
        );
    }
    tracing::info!(
        model = app.model.name(),
        context = app.context,
        max_batch = engine.handle().max_batch(),
        api_key = options.api_key.is_some(),
        "model ready"
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("lily-http")
        .build()
        .context("cannot start the async runtime")?;
    let served = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((options.host.as_str(), options.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", options.host, options.port))?;
        let address: SocketAddr = listener.local_addr()?;
        tracing::info!("listening on http://{address}");
        let shutdown = shutdown_on_signal(app.engine.clone(), options.shutdown_grace);
        axum::serve(listener, router(app.clone(), options.max_body_bytes))
            .with_graceful_shutdown(shutdown)
            .await
            .context("the HTTP server failed")
    });
    drop(app);
    runtime.shutdown_timeout(Duration::from_secs(1));
    engine.join();
    tracing::info!("stopped");
    served
}

/// Resolves at the first SIGINT or SIGTERM: new requests are refused from then on, and running
/// ones get `grace` to finish (a second signal cancels them at once).
async fn shutdown_on_signal(engine: EngineHandle, grace: Duration) {
    termination_signal().await;
    tracing::info!(
        "shutting down: refusing new requests, letting running ones finish (up to {grace:?}; \
         signal again to cancel them)"
    );
    engine.stop_accepting();
    tokio::spawn(async move {
        tokio::select! {
            () = termination_signal() => {}
            () = tokio::time::sleep(grace) => {}
        }
        tracing::warn!("cancelling the requests still running");
        engine.cancel_all();
    });
}

async fn termination_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(signal) => signal,
                Err(e) => {
                    tracing::error!("cannot listen for SIGTERM: {e}");
                    let _ = interrupt.await;
                    return;
                }
            };
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}

//! What both generation endpoints share: reading the common request fields into engine
//! requests (model name, sampling, stop strings, `n`, token budget), submitting them, and
//! reading their events back as one stream of `(choice index, event)`.

use std::time::Instant;

use futures_util::stream::{self, BoxStream, StreamExt};
use serde_json::Value;
use tokio::sync::mpsc::UnboundedReceiver;

use super::AppState;
use super::errors::ApiError;
use super::openai::{CommonFields, Usage};
use crate::engine::constraint::Constraint;
use crate::engine::generate::GenerationParams;
use crate::engine::sampler::SamplingParams;
use crate::engine::scheduler::{Event, GenerationRequest};

/// The most choices (`n`) one request may ask for.
const MAX_CHOICES: usize = 16;
/// The most stop strings one request may give.
const MAX_STOP_STRINGS: usize = 16;
/// The largest `top_logprobs` / `logprobs` count.
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// What a constraint holds a reply to.
pub enum Shape {
    /// A JSON value of this schema (any JSON object without one): `response_format`.
    Json(Option<Value>),
    /// Only tool calls, by this grammar: a forced `tool_choice`.
    Calls(String),
}

impl Shape {
    /// The constraint, compiled for the served tokenizer (blocking: the first one builds the
    /// tokenizer's trie). Errors name the request field the shape came from.
    pub fn constraint(self, app: &AppState) -> Result<Constraint, ApiError> {
        let param = match self {
            Shape::Json(_) => "response_format",
            Shape::Calls(_) => "tool_choice",
        };
        let grammars = app.grammars().map_err(|e| ApiError::invalid(param, e))?;
        match self {
            Shape::Json(schema) => grammars.json(schema.as_ref()),
            Shape::Calls(grammar) => grammars.lark(&grammar),
        }
        .map_err(|e| ApiError::invalid(param, format!("The schema cannot be used: {e:#}")))
    }
}

/// Runs request work that can take seconds (rendering a long conversation, tokenising a prompt
/// of megabytes) on tokio's blocking threads, so that the async workers keep answering other
/// requests meanwhile.
pub async fn off_the_workers<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::internal(format!("preparing the prompt failed: {e}")))?
}

/// The common fields of a request, checked.
#[derive(Debug)]
pub struct Plan {
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    pub return_token_ids: bool,
    /// `max_tokens` as given (at least 1); the default fills the context.
    pub max_tokens: Option<usize>,
    /// The field that gave it (chat's `max_completion_tokens` or `max_tokens`), for errors.
    pub max_tokens_param: &'static str,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Ids that end a reply unwritten: the model's end-of-sequence ids (unless `ignore_eos`)
    /// and `stop_token_ids`.
    pub eos_token_ids: Vec<u32>,
    /// Ids that end a reply once written (see `GenerationParams::end_after_ids`).
    pub end_after_ids: Vec<u32>,
    /// Tokens before `eos_token_ids` may end the reply.
    pub min_tokens: usize,
    pub logit_bias: Vec<(u32, f32)>,
    /// Alternatives per prompt token where the prompt is scored (completions' `echo` with
    /// `logprobs`; see `GenerationRequest::prompt_logprobs`).
    pub prompt_logprobs: Option<usize>,
}

impl Plan {
    /// Checks the common fields against the served model; `max_tokens` is the endpoint's
    /// token budget field (chat also accepts `max_completion_tokens`).
    pub fn read(
        common: CommonFields,
        max_tokens: Option<(i64, &'static str)>,
        app: &AppState,
    ) -> Result<Self, ApiError> {
        app.check_model(common.model.as_deref())?;
        let n = match common.n {
            None => 1,
            Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => n as usize,
            Some(n) => {
                return Err(ApiError::invalid(
                    "n",
                    format!("`n` must be between 1 and {MAX_CHOICES}, got {n}."),
                ));
            }
        };
        let max_tokens_param = max_tokens.map_or("max_tokens", |(_, field)| field);
        let max_tokens = match max_tokens {
            None => None,
            Some((m, _)) if m >= 1 => Some(m as usize),
            Some((m, field)) => {
                return Err(ApiError::invalid(
                    field,
                    format!("`{field}` must be at least 1, got {m}."),
                ));
            }
        };
        let defaults = &app.model.sampling_defaults;
        let top_k = match common.top_k {
            None => defaults.top_k,
            Some(-1 | 0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("`top_k` must be -1 (off) or positive, got {k}."),
                ));
            }
        };
        let sampling = SamplingParams {
            temperature: common.temperature.unwrap_or(defaults.temperature),
            top_k,
            top_p: common.top_p.unwrap_or(defaults.top_p),
            min_p: common.min_p.unwrap_or(defaults.min_p),
            repetition_penalty: common
                .repetition_penalty
                .unwrap_or(defaults.repetition_penalty),
            presence_penalty: common.presence_penalty.unwrap_or(0.0),
            frequency_penalty: common.frequency_penalty.unwrap_or(0.0),
            seed: common.seed.map(|s| s as u64),
        };
        sampling
            .validate()
            .map_err(|e| ApiError::invalid(e.field, e.to_string()))?;
        let stop = common.stop.map(|s| s.into_vec()).unwrap_or_default();
        if stop.len() > MAX_STOP_STRINGS {
            return Err(ApiError::invalid(
                "stop",
                format!("At most {MAX_STOP_STRINGS} stop strings are supported."),
            ));
        }
        if !stop.is_empty() && app.model.tokenizer.is_none() {
            return Err(ApiError::invalid(
                "stop",
                "Stop strings need a tokenizer, and this model has none (no tokenizer.json).",
            ));
        }
        let logit_bias = common
            .logit_bias
            .unwrap_or_default()
            .into_iter()
            .map(|(key, bias)| {
                let id = key
                    .parse::<u32>()
                    .ok()
                    .filter(|&id| (id as usize) < app.engine.vocab_size());
                let bias = bias
                    .as_f64()
                    .filter(|b| (-100.0..=100.0).contains(b))
                    .map(|b| b as f32);
                match (id, bias) {
                    (Some(id), Some(bias)) => Ok((id, bias)),
                    _ => Err(ApiError::invalid(
                        "logit_bias",
                        format!(
                            "`logit_bias` maps token ids (below {}) to numbers in [-100, 100]; \
                             entry {key:?} is not one.",
                            app.engine.vocab_size()
                        ),
                    )),
                }
            })
            .collect::<Result<_, _>>()?;
        let mut eos_token_ids = if common.ignore_eos.unwrap_or(false) {
            Vec::new()
        } else {
            app.model.eos_token_ids.clone()
        };
        for id in common.stop_token_ids.unwrap_or_default() {
            let id = u32::try_from(id)
                .ok()
                .filter(|&id| (id as usize) < app.engine.vocab_size())
                .ok_or_else(|| {
                    ApiError::invalid(
                        "stop_token_ids",
                        format!(
                            "`stop_token_ids` holds ids of the vocabulary (below {}), not {id}.",
                            app.engine.vocab_size()
                        ),
                    )
                })?;
            eos_token_ids.push(id);
        }
        let min_tokens = match common.min_tokens {
            None => 0,
            Some(m) if m >= 0 && max_tokens.is_none_or(|max| m as usize <= max) => m as usize,
            Some(m) => {
                return Err(ApiError::invalid(
                    "min_tokens",
                    format!("`min_tokens` must be between 0 and `{max_tokens_param}`, got {m}."),
                ));
            }
        };
        Ok(Self {
            n,
            stream: common.stream.unwrap_or(false),
            include_usage: common
                .stream_options
                .is_some_and(|o| o.include_usage.unwrap_or(false)),
            return_token_ids: common.return_token_ids.unwrap_or(false),
            max_tokens,
            max_tokens_param,
            sampling,
            stop,
            eos_token_ids,
            end_after_ids: Vec::new(),
            min_tokens,
            logit_bias,
            prompt_logprobs: None,
        })
    }

    /// Checks that the prompt and the requested output fit the context; returns the token budget.
    pub fn token_budget(
        &self,
        prompt_tokens: usize,
        prompt_param: &'static str,
        app: &AppState,
    ) -> Result<usize, ApiError> {
        let context = app.context;
        if prompt_tokens == 0 {
            return Err(ApiError::invalid(prompt_param, "The prompt is empty."));
        }
        if prompt_tokens >= context {
            return Err(ApiError::invalid(
                prompt_param,
                format!(
                    "This model's maximum context length is {context} tokens. However, your \
                     prompt has {prompt_tokens} tokens, leaving no room for a completion."
                ),
            )
            .with_code("context_length_exceeded"));
        }
        match self.max_tokens {
            None => Ok(context - prompt_tokens),
            Some(m) if prompt_tokens + m <= context => Ok(m),
            Some(m) => Err(ApiError::invalid(
                self.max_tokens_param,
                format!(
                    "This model's maximum context length is {context} tokens. However, you \
                     requested {} tokens ({prompt_tokens} in the prompt, {m} for the \
                     completion). Please reduce the prompt or the completion length.",
                    prompt_tokens + m
                ),
            )
            .with_code("context_length_exceeded")),
        }
    }

    /// Queues one engine request per choice. With a seed, choice `i` draws with `seed + i`, so
    /// choices differ but the response is reproducible. `cache_points` are the prompt lengths
    /// worth keeping in the prefix cache (see `GenerationRequest`).
    pub fn submit(
        &self,
        app: &AppState,
        prompt: &[u32],
        cache_points: &[usize],
        max_tokens: usize,
        logprobs: Option<usize>,
        constraint: Option<&Constraint>,
    ) -> Result<Vec<UnboundedReceiver<Event>>, ApiError> {
        (0..self.n)
            .map(|i| {
                let mut sampling = self.sampling.clone();
                sampling.seed = sampling.seed.map(|s| s.wrapping_add(i as u64));
                let request = GenerationRequest {
                    prompt: prompt.to_vec(),
                    cache_points: cache_points.to_vec(),
                    params: GenerationParams {
                        max_tokens,
                        sampling,
                        stop: self.stop.clone(),
                        eos_token_ids: self.eos_token_ids.clone(),
                        end_after_ids: self.end_after_ids.clone(),
                        min_tokens: self.min_tokens,
                    },
                    logprobs,
                    prompt_logprobs: self.prompt_logprobs,
                    logit_bias: self.logit_bias.clone(),
                    constraint: constraint.cloned(),
                };
                app.engine.submit(request).map_err(ApiError::from)
            })
            // A failure drops the receivers already made, which cancels their requests.
            .collect()
    }
}

/// Logs a request that was answered in full.
pub fn log_answered(id: &str, usage: &Usage, finishes: &[Option<&str>], started: Instant) {
    tracing::info!(
        id,
        prompt_tokens = usage.prompt_tokens,
        completion_tokens = usage.completion_tokens,
        finish = ?finishes.iter().map(|f| f.unwrap_or("none")).collect::<Vec<_>>(),
        seconds = started.elapsed().as_secs_f64(),
        "answered"
    );
}

/// The events of every choice, merged, each with its choice index. A choice whose channel
/// closes without a final event (the engine stopped) gets a failure.
pub fn merged_events(
    receivers: Vec<UnboundedReceiver<Event>>,
) -> BoxStream<'static, (usize, Event)> {
    let streams = receivers.into_iter().enumerate().map(|(index, receiver)| {
        stream::unfold(Some(receiver), move |receiver| async move {
            let mut receiver = receiver?;
            match receiver.recv().await {
                Some(event @ (Event::Finished { .. } | Event::Failed(_))) => {
                    Some(((index, event), None))
                }
                Some(event) => Some(((index, event), Some(receiver))),
                None => Some((
                    (index, Event::Failed("the engine stopped".to_owned())),
                    None,
                )),
            }
        })
        .boxed()
    });
    stream::select_all(streams).boxed()
}

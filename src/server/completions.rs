//! `POST /v1/completions`: a raw prompt (text or token ids, no chat template), or a batch of
//! them, continued and answered as a text completion, whole or streamed. A batch's choices are
//! numbered prompt by prompt (`index = prompt * n + j`), as OpenAI numbers them.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::Response;
use serde_json::{Map, Value};

use super::chat::json_schema_of;
use super::chat::token_text;
use super::errors::{ApiError, JsonObject, fields_and_unread, warn_unread};
use super::generation::{
    MAX_TOP_LOGPROBS, Plan, Shape, log_answered, merged_events, off_the_workers,
};
use super::openai::{
    CommonFields, Completion, CompletionChoice, CompletionFields, CompletionLogprobs, Prompt,
    Usage, logprob_value,
};
use super::stream::{self, ChunkWriter, SseChunk, chunk, respond};
use super::{AppState, unix_now};
use crate::engine::generate::FinishReason;
use crate::engine::scheduler::{Event, TokenLogprobs};
use crate::text::tokenizer::Tokenizer;

pub async fn completions(
    State(app): State<Arc<AppState>>,
    JsonObject(body): JsonObject,
) -> Result<Response, ApiError> {
    let (common, common_unread) = fields_and_unread::<CommonFields>(&body)?;
    let (fields, fields_unread) = fields_and_unread::<CompletionFields>(&body)?;
    warn_unread("/v1/completions", &[common_unread, fields_unread]);
    let echo = fields.echo.unwrap_or(false);
    // `max_tokens: 0` with `echo` only scores the prompt (the legacy API's way to ask for a
    // text's logprobs).
    let scores_only = echo && common.max_tokens == Some(0);
    let max_tokens = common
        .max_tokens
        .filter(|_| !scores_only)
        .map(|m| (m, "max_tokens"));
    let mut plan = Plan::read(common, max_tokens, &app)?;
    if scores_only {
        plan.max_tokens = Some(0);
    }
    if fields.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "`suffix` is not supported."));
    }
    if let Some(best_of) = fields.best_of
        && best_of != plan.n as i64
    {
        return Err(ApiError::invalid(
            "best_of",
            "`best_of` is not supported (other than equal to `n`).",
        ));
    }
    let logprobs = match fields.logprobs {
        None => None,
        Some(k) if (0..=MAX_TOP_LOGPROBS).contains(&k) => Some(k as usize),
        Some(k) => {
            return Err(ApiError::invalid(
                "logprobs",
                format!("`logprobs` must be between 0 and {MAX_TOP_LOGPROBS}, got {k}."),
            ));
        }
    };
    // The echoed prompt is scored as well: each token's logprob given those before it.
    if echo {
        plan.prompt_logprobs = logprobs;
    }
    let constraint = match json_schema_of(fields.response_format)? {
        None => None,
        Some(schema) => {
            let grammar_app = app.clone();
            Some(off_the_workers(move || Shape::Json(schema).constraint(&grammar_app)).await?)
        }
    };
    let tokenizer = app.model.tokenizer.clone();
    let mut prompts = Vec::new();
    match fields.prompt {
        Prompt::Text(text) => prompts.push(text_prompt(tokenizer.clone(), text).await?),
        Prompt::Texts(texts) => {
            for text in texts {
                prompts.push(text_prompt(tokenizer.clone(), text).await?);
            }
        }
        Prompt::Ids(ids) => prompts.push(id_prompt(&app, tokenizer.as_deref(), ids)?),
        Prompt::IdLists(lists) => {
            for ids in lists {
                prompts.push(id_prompt(&app, tokenizer.as_deref(), ids)?);
            }
        }
    }
    if prompts.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` is an empty list."));
    }
    if prompts.len() > 1 && plan.return_token_ids {
        return Err(ApiError::invalid(
            "return_token_ids",
            "`return_token_ids` takes one prompt: send a batch's prompts one per request.",
        ));
    }
    let mut receivers = Vec::new();
    for (prompt, _) in &prompts {
        let budget = plan.token_budget(prompt.len(), "prompt", &app)?;
        // No cache points: a raw prompt has no known place where later ones diverge, and each
        // point splits the prefill. A finished completion still leaves its state for a
        // continuation.
        receivers.extend(plan.submit(&app, prompt, &[], budget, logprobs, constraint.as_ref())?);
    }
    let reply = Reply {
        id: format!("cmpl-{}", uuid::Uuid::new_v4().simple()),
        created: unix_now(),
        model: app.model.name().to_owned(),
        tokenizer,
        prompt_ids: plan
            .return_token_ids
            .then(|| prompts.first().map(|(ids, _)| ids.clone()))
            .flatten(),
        prompts: prompts
            .into_iter()
            .map(|(ids, text)| PromptOf {
                ids,
                echo: echo.then_some(text),
            })
            .collect(),
        n: plan.n,
        choices: (0..receivers.len())
            .map(|_| ChoiceOutput {
                text: String::new(),
                logprobs: logprobs.map(|_| CompletionLogprobs::default()),
                token_ids: Vec::new(),
                finish: None,
                completion_tokens: 0,
                cached_tokens: 0,
                started: false,
            })
            .collect(),
        include_usage: plan.include_usage,
        return_token_ids: plan.return_token_ids,
        started: Instant::now(),
    };
    respond(merged_events(receivers), reply, plan.stream).await
}

async fn text_prompt(
    tokenizer: Option<Arc<Tokenizer>>,
    text: String,
) -> Result<(Vec<u32>, String), ApiError> {
    let tokenizer = tokenizer.ok_or_else(|| {
        ApiError::invalid(
            "prompt",
            "This model has no tokenizer (tokenizer.json): give the prompt as token ids.",
        )
    })?;
    off_the_workers(move || {
        let ids = tokenizer
            .encode(&text)
            .map_err(|e| ApiError::invalid("prompt", format!("{e:#}")))?;
        Ok((ids, text))
    })
    .await
}

fn id_prompt(
    app: &AppState,
    tokenizer: Option<&Tokenizer>,
    ids: Vec<u32>,
) -> Result<(Vec<u32>, String), ApiError> {
    let vocab = app.engine.vocab_size();
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(ApiError::invalid(
            "prompt",
            format!("Token id {bad} is outside the vocabulary (size {vocab})."),
        ));
    }
    let text = tokenizer
        .and_then(|t| t.decode(&ids).ok())
        .unwrap_or_default();
    Ok((ids, text))
}

struct ChoiceOutput {
    text: String,
    logprobs: Option<CompletionLogprobs>,
    token_ids: Vec<u32>,
    finish: Option<&'static str>,
    completion_tokens: usize,
    /// Prompt tokens the engine took from its prefix cache.
    cached_tokens: usize,
    /// Whether a chunk of this choice has been streamed (the echo goes in the first).
    started: bool,
}

/// One prompt of the request.
struct PromptOf {
    ids: Vec<u32>,
    /// The prompt's text, where `echo` asks for it before each of its choices.
    echo: Option<String>,
}

/// A text completion being assembled from engine events (whole or as a stream).
struct Reply {
    id: String,
    created: u64,
    model: String,
    tokenizer: Option<Arc<Tokenizer>>,
    /// The prompt's ids, where `return_token_ids` asks for them (one prompt only).
    prompt_ids: Option<Vec<u32>>,
    prompts: Vec<PromptOf>,
    /// Choices per prompt: choice i continues prompt i / n.
    n: usize,
    choices: Vec<ChoiceOutput>,
    include_usage: bool,
    return_token_ids: bool,
    started: Instant,
}

/// What one event added to a choice.
struct Step {
    text: String,
    logprobs: Option<CompletionLogprobs>,
    finish: Option<&'static str>,
    token_id: Option<u32>,
}

impl Reply {
    /// The echoed prompt text that starts choice `index`.
    fn echo_of(&self, index: usize) -> Option<&str> {
        self.prompts[index / self.n].echo.as_deref()
    }

    fn step(&mut self, index: usize, event: Event) -> Result<Step, ApiError> {
        let echoed = self.echo_of(index).map_or(0, str::len);
        let choice = &mut self.choices[index];
        match event {
            Event::Token { id, text, logprobs } => {
                choice.token_ids.push(id);
                let offset = echoed + choice.text.len();
                let logprobs = match (&mut choice.logprobs, logprobs) {
                    (Some(all), Some(l)) => {
                        let one = legacy_logprobs(self.tokenizer.as_deref(), id, &l, offset);
                        extend(all, &one);
                        Some(one)
                    }
                    _ => None,
                };
                choice.text.push_str(&text);
                Ok(Step {
                    text,
                    logprobs,
                    finish: None,
                    token_id: Some(id),
                })
            }
            Event::Finished {
                reason,
                completion_tokens,
                cached_tokens,
            } => {
                choice.completion_tokens = completion_tokens;
                choice.cached_tokens = cached_tokens;
                let finish = match reason {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                };
                choice.finish = Some(finish);
                Ok(Step {
                    text: String::new(),
                    logprobs: None,
                    finish: Some(finish),
                    token_id: None,
                })
            }
            Event::PromptLogprobs(scores) => {
                let ids = &self.prompts[index / self.n].ids;
                let logprobs = choice.logprobs.as_mut().map(|all| {
                    let prompt = prompt_logprobs(self.tokenizer.as_deref(), ids, &scores);
                    extend(all, &prompt);
                    prompt
                });
                Ok(Step {
                    text: String::new(),
                    logprobs,
                    finish: None,
                    token_id: None,
                })
            }
            Event::Failed(message) => Err(ApiError::internal(message)),
        }
    }

    fn log(&self) {
        let finishes: Vec<_> = self.choices.iter().map(|c| c.finish).collect();
        log_answered(&self.id, &self.usage(), &finishes, self.started);
    }

    /// Each prompt counted once, with the most any of its choices took from the cache.
    fn usage(&self) -> Usage {
        Usage::new(
            self.prompts.iter().map(|p| p.ids.len()).sum(),
            self.choices.iter().map(|c| c.completion_tokens).sum(),
            self.choices
                .chunks(self.n)
                .map(|of_prompt| of_prompt.iter().map(|c| c.cached_tokens).max().unwrap_or(0))
                .sum(),
        )
    }

    fn envelope(&self, choices: Vec<CompletionChoice>) -> Completion {
        Completion {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: None,
            prompt_token_ids: None,
        }
    }
}

impl stream::Reply for Reply {
    type Whole = Completion;

    fn record(&mut self, index: usize, event: Event) -> Result<(), ApiError> {
        self.step(index, event).map(drop)
    }

    fn whole(mut self) -> Completion {
        self.log();
        let usage = self.usage();
        let return_token_ids = self.return_token_ids;
        let choices = std::mem::take(&mut self.choices)
            .into_iter()
            .enumerate()
            .map(|(index, c)| CompletionChoice {
                index,
                text: format!("{}{}", self.echo_of(index).unwrap_or_default(), c.text),
                logprobs: c.logprobs,
                finish_reason: c.finish,
                token_ids: return_token_ids.then_some(c.token_ids),
            })
            .collect();
        let mut completion = self.envelope(choices);
        completion.usage = Some(Some(usage));
        completion.prompt_token_ids = self.prompt_ids.take();
        completion
    }
}

impl ChunkWriter for Reply {
    fn on_event(&mut self, index: usize, event: Event) -> Result<Vec<SseChunk>, ApiError> {
        let step = self.step(index, event)?;
        let choice = &mut self.choices[index];
        let first = !choice.started;
        choice.started = true;
        let mut text = step.text;
        if first && let Some(echo) = self.echo_of(index) {
            text.insert_str(0, echo);
        }
        if text.is_empty()
            && step.logprobs.is_none()
            && step.finish.is_none()
            && !self.return_token_ids
            && !first
        {
            return Ok(Vec::new());
        }
        let mut c = self.envelope(vec![CompletionChoice {
            index,
            text,
            logprobs: step.logprobs,
            finish_reason: step.finish,
            token_ids: self
                .return_token_ids
                .then(|| step.token_id.into_iter().collect()),
        }]);
        if first {
            c.prompt_token_ids = self.prompt_ids.clone();
        }
        if self.include_usage {
            c.usage = Some(None);
        }
        Ok(vec![chunk(&c).into()])
    }

    fn on_end(&mut self) -> Vec<SseChunk> {
        self.log();
        if !self.include_usage {
            return Vec::new();
        }
        let mut c = self.envelope(Vec::new());
        c.usage = Some(Some(self.usage()));
        vec![chunk(&c).into()]
    }
}

/// A token's text in a listing (its id where the model has no tokenizer).
fn listed_text(tokenizer: Option<&Tokenizer>, id: u32) -> String {
    match tokenizer {
        Some(t) => token_text(t, id),
        None => format!("token_id:{id}"),
    }
}

/// One token in the legacy format: its text, log-probability, top alternatives (the token
/// itself among them, as OpenAI lists it: up to `logprobs` + 1 entries), text offset.
fn legacy_logprobs(
    tokenizer: Option<&Tokenizer>,
    id: u32,
    l: &TokenLogprobs,
    offset: usize,
) -> CompletionLogprobs {
    let mut top: Map<String, Value> = l
        .top
        .iter()
        .map(|t| (listed_text(tokenizer, t.token_id), logprob_value(t.logprob)))
        .collect();
    let text = listed_text(tokenizer, id);
    if l.logprob.is_finite() {
        top.entry(text.clone())
            .or_insert_with(|| logprob_value(l.logprob));
    }
    CompletionLogprobs {
        tokens: vec![text],
        token_logprobs: vec![Some(l.logprob)],
        top_logprobs: vec![Some(top)],
        text_offset: vec![offset],
    }
}

/// The echoed prompt `ids` in the legacy format, `scores` for its tokens after the first (the
/// first has none: `null`). A token's offset is where the prompt's text is at when it starts:
/// the length of what its decoding has made final, so that offsets keep within the echoed text
/// (a token's own text may be a piece of a character, listed as U+FFFD).
fn prompt_logprobs(
    tokenizer: Option<&Tokenizer>,
    ids: &[u32],
    scores: &[TokenLogprobs],
) -> CompletionLogprobs {
    let mut all = CompletionLogprobs::default();
    let mut decoder = tokenizer.map(Tokenizer::incremental_decoder);
    let mut offset = 0;
    for (i, &id) in ids.iter().enumerate() {
        let one = match i.checked_sub(1).and_then(|before| scores.get(before)) {
            Some(l) => legacy_logprobs(tokenizer, id, l, offset),
            None => CompletionLogprobs {
                tokens: vec![listed_text(tokenizer, id)],
                token_logprobs: vec![None],
                top_logprobs: vec![None],
                text_offset: vec![offset],
            },
        };
        if let Some(d) = &mut decoder {
            offset += d.push(id).map_or(0, |text| text.len());
        }
        extend(&mut all, &one);
    }
    all
}

fn extend(all: &mut CompletionLogprobs, one: &CompletionLogprobs) {
    all.tokens.extend(one.tokens.iter().cloned());
    all.token_logprobs.extend(&one.token_logprobs);
    all.top_logprobs.extend(one.top_logprobs.iter().cloned());
    all.text_offset.extend(&one.text_offset);
}

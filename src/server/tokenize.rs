//! vLLM's `POST /tokenize` and `POST /detokenize`: a prompt, or a conversation rendered with the
//! chat template exactly as `/v1/chat/completions` renders it, to token ids; and ids back to
//! text. Clients use them to count a request's tokens against the context before sending it.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::AppState;
use super::chat::template_context;
use super::errors::{ApiError, JsonObject, fields};
use super::generation::off_the_workers;
use super::openai::ChatMessage;
use crate::text::tokenizer::Tokenizer;

/// The fields of a `/tokenize` request: `prompt`, or `messages` with the chat fields that shape
/// the rendered conversation (`tools` and `tool_choice` are read from the body as chat reads
/// them). vLLM's `add_special_tokens` is ignored: Qwen's tokenizer adds none to a prompt.
#[derive(Debug, Deserialize)]
struct TokenizeFields {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<ChatMessage>>,
    /// vLLM's field, taken as `chat_template_kwargs.add_generation_prompt`.
    add_generation_prompt: Option<bool>,
    chat_template_kwargs: Option<Map<String, Value>>,
    reasoning_effort: Option<String>,
}

#[derive(Debug, Deserialize)]
struct DetokenizeFields {
    model: Option<String>,
    tokens: Vec<i64>,
}

/// The served tokenizer, for a request naming `model` (if it does) to `verb` with it.
fn served_tokenizer(
    app: &AppState,
    model: Option<&str>,
    verb: &str,
) -> Result<Arc<Tokenizer>, ApiError> {
    app.check_model(model)?;
    app.model.tokenizer.clone().ok_or_else(|| {
        ApiError::invalid(
            None,
            format!("This model has no tokenizer (tokenizer.json) to {verb} with."),
        )
    })
}

pub async fn tokenize(
    State(app): State<Arc<AppState>>,
    JsonObject(body): JsonObject,
) -> Result<Json<Value>, ApiError> {
    let f: TokenizeFields = fields(&body)?;
    let tokenizer = served_tokenizer(&app, f.model.as_deref(), "tokenize")?;
    let text = match (f.prompt, f.messages) {
        (Some(prompt), None) => prompt,
        (None, Some(messages)) => {
            let Some(template) = app.model.chat_template.clone() else {
                return Err(ApiError::invalid(
                    "messages",
                    "This model has no chat template to render `messages` with.",
                ));
            };
            let mut kwargs = f.chat_template_kwargs.unwrap_or_default();
            if let Some(add) = f.add_generation_prompt {
                kwargs.insert("add_generation_prompt".into(), Value::Bool(add));
            }
            let context =
                template_context(&body, messages, Some(kwargs), f.reasoning_effort.as_deref())?;
            off_the_workers(move || {
                template
                    .render(&Value::Object(context))
                    .map_err(|e| ApiError::invalid("messages", format!("{e:#}")))
            })
            .await?
        }
        _ => {
            return Err(ApiError::invalid(
                None,
                "Give either `prompt` (text) or `messages` (a conversation), not both.",
            ));
        }
    };
    let tokens = off_the_workers(move || {
        tokenizer
            .encode(&text)
            .map_err(|e| ApiError::invalid(None, format!("{e:#}")))
    })
    .await?;
    Ok(Json(json!({
        "count": tokens.len(),
        "max_model_len": app.context,
        "tokens": tokens,
    })))
}

pub async fn detokenize(
    State(app): State<Arc<AppState>>,
    JsonObject(body): JsonObject,
) -> Result<Json<Value>, ApiError> {
    let f: DetokenizeFields = fields(&body)?;
    let tokenizer = served_tokenizer(&app, f.model.as_deref(), "detokenize")?;
    let vocab = tokenizer.vocab_size();
    let ids = f
        .tokens
        .iter()
        .map(|&id| u32::try_from(id).ok().filter(|&id| (id as usize) < vocab))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| {
            ApiError::invalid(
                "tokens",
                format!("`tokens` holds ids of the vocabulary (0 to {}).", vocab - 1),
            )
        })?;
    let prompt = off_the_workers(move || {
        tokenizer
            .decode(&ids)
            .map_err(|e| ApiError::invalid("tokens", format!("{e:#}")))
    })
    .await?;
    Ok(Json(json!({ "prompt": prompt })))
}

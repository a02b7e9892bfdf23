//! The OpenAI API's request and response bodies, as typed serde structs.
//!
//! A request body is read in two parts: [`CommonFields`] (model, sampling, stop, streaming, ...)
//! shared by both endpoints, and the endpoint's own fields ([`ChatFields`] or
//! [`CompletionFields`]). Unknown fields are ignored, as OpenAI-compatible servers do; fields
//! of the wrong type are errors naming the field.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Fields both `/v1/chat/completions` and `/v1/completions` take.
#[derive(Debug, Default, Deserialize)]
pub struct CommonFields {
    pub model: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub n: Option<i64>,
    pub logit_bias: Option<Map<String, Value>>,
    /// vLLM's extension: also return the prompt's and each choice's token ids.
    pub return_token_ids: Option<bool>,
    /// vLLM's extension: the end-of-sequence ids do not end the reply (benchmarks that want a
    /// fixed output length send it).
    pub ignore_eos: Option<bool>,
    /// vLLM's extension: more token ids that end the reply (not emitted as text).
    pub stop_token_ids: Option<Vec<i64>>,
    /// vLLM's extension: tokens generated before an end-of-sequence or stop token id may be.
    pub min_tokens: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// `stop`: one string or a list of them.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// The fields only `/v1/chat/completions` takes.
#[derive(Debug, Deserialize)]
pub struct ChatFields {
    pub messages: Vec<ChatMessage>,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub tools: Option<Vec<Tool>>,
    pub tool_choice: Option<ToolChoice>,
    /// False: a forced (`required`) reply makes one call, an `auto` reply ends after its first.
    pub parallel_tool_calls: Option<bool>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    pub response_format: Option<ResponseFormat>,
    /// `none` turns Qwen's thinking off; the other efforts leave it on.
    pub reasoning_effort: Option<String>,
}

/// A message of the conversation.
#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<MessageContent>,
    pub name: Option<String>,
    pub tool_calls: Option<Vec<MessageToolCall>>,
    pub tool_call_id: Option<String>,
    pub reasoning_content: Option<String>,
}

/// A message's content: a string or a list of parts.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// A tool call in an assistant message of the conversation.
#[derive(Debug, Deserialize)]
pub struct MessageToolCall {
    pub id: Option<String>,
    pub function: MessageFunctionCall,
}

#[derive(Debug, Deserialize)]
pub struct MessageFunctionCall {
    pub name: String,
    /// A JSON object as a string (as OpenAI sends it) or, leniently, the object itself.
    #[serde(default)]
    pub arguments: Value,
}

/// A tool the model may call.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDefinition,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct FunctionDefinition {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"` or a named function.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ToolChoice {
    Mode(String),
    Named(Value),
}

/// `response_format`: `text`, `json_object` or `json_schema` (structured output).
#[derive(Debug, Deserialize)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: String,
    pub json_schema: Option<JsonSchemaFormat>,
}

/// `response_format.json_schema`. Its `name`, `description` and `strict` change nothing: the
/// schema is always enforced.
#[derive(Debug, Deserialize)]
pub struct JsonSchemaFormat {
    pub schema: Option<Value>,
}

/// The fields only `/v1/completions` takes.
#[derive(Debug, Deserialize)]
pub struct CompletionFields {
    pub prompt: Prompt,
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
    /// Structured output, as on chat (vLLM takes it here too).
    pub response_format: Option<ResponseFormat>,
}

/// `prompt`: text, token ids, or a batch of either.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens taken from the prefix cache instead of prefilled.
    pub cached_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// A chat completion (`object: "chat.completion"`) or one chunk of a stream of them
/// (`"chat.completion.chunk"`, with `delta` instead of `message` in the choices).
#[derive(Debug, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<ReplyMessage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<AssistantMessage>,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// The assistant's whole reply: `content` is null when the reply is only tool calls.
#[derive(Debug, Serialize)]
pub struct ReplyMessage {
    pub role: &'static str,
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

/// The part of the reply a stream chunk adds (and, accumulated, the whole reply).
#[derive(Debug, Default, Serialize)]
pub struct AssistantMessage {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

/// A tool call the model made. In a stream chunk `index` says which call it is.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ToolCallOut {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCallOut,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FunctionCallOut {
    pub name: String,
    /// The arguments as a JSON object serialised to a string.
    pub arguments: String,
}

#[derive(Debug, Default, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    #[serde(serialize_with = "serialize_logprob")]
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

#[derive(Debug, Serialize)]
pub struct ChatTopLogprob {
    pub token: String,
    #[serde(serialize_with = "serialize_logprob")]
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// A logprob as a JSON number: the f32's shortest decimal (-0.5566907), written the same
/// whether serialised directly or through a `Value`, which would otherwise hold the f64 widening
/// (-0.5566906929016113). Otherwise the same logprob written both ways in one reply (a chosen
/// token and the same token among the alternatives) stops comparing equal, as clients' greedy
/// checks expect it to.
pub fn logprob_value(logprob: f32) -> Value {
    Value::from(logprob.to_string().parse::<f64>().unwrap_or(f64::NAN))
}

fn serialize_logprob<S: serde::Serializer>(logprob: &f32, s: S) -> Result<S::Ok, S::Error> {
    logprob_value(*logprob).serialize(s)
}

/// A text completion (`object: "text_completion"`), whole or one chunk of a stream.
#[derive(Debug, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Serialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// The legacy completions log-probability format: parallel lists per token. An echoed prompt's
/// first token has no logprob or alternatives (`null`): nothing comes before it.
#[derive(Debug, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<Map<String, Value>>>,
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub max_model_len: usize,
}

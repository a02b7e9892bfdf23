//! `POST /v1/responses`: OpenAI's Responses API over the chat path. A request (`instructions`,
//! `input` items, function `tools`, `text.format`, `reasoning`) becomes a chat completion
//! request, is queued as one, and its reply is answered as a response: output items (reasoning,
//! the message, function calls), whole or as a stream of typed events. Nothing is stored, so
//! `previous_response_id` is refused: clients send the whole conversation as `input`.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::Response;
use serde_json::{Map, Value, json};

use super::chat::{ChoiceOutput, queue_chat, token_logprob};
use super::errors::{ApiError, JsonObject};
use super::generation::{log_answered, merged_events};
use super::openai::{AssistantMessage, Usage};
use super::stream::{self, ChunkWriter, SseChunk, respond};
use super::{AppState, unix_now};
use crate::engine::generate::FinishReason;
use crate::engine::scheduler::Event;
use crate::text::tokenizer::Tokenizer;

pub async fn responses(
    State(app): State<Arc<AppState>>,
    JsonObject(body): JsonObject,
) -> Result<Response, ApiError> {
    let chat = chat_request(&body)?;
    let queued = queue_chat(&app, chat).await.map_err(responses_param)?;
    let stream = queued.plan.stream;
    let reply = ResponseReply::new(
        app.model.name(),
        echoed_fields(&body),
        ChoiceOutput::new(&queued),
        queued.prompt.len(),
        queued.tokenizer.clone(),
    );
    respond(merged_events(queued.receivers), reply, stream).await
}

/// Request fields that pass to the chat request as they are (lily's sampling extensions too).
const SHARED_FIELDS: [&str; 12] = [
    "model",
    "stream",
    "parallel_tool_calls",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "chat_template_kwargs",
];

/// The chat completion request a Responses request asks for.
fn chat_request(body: &Value) -> Result<Value, ApiError> {
    let mut chat = Map::new();
    for key in SHARED_FIELDS {
        if let Some(v) = body.get(key) {
            chat.insert(key.into(), v.clone());
        }
    }
    if body
        .get("previous_response_id")
        .is_some_and(|v| !v.is_null())
    {
        return Err(ApiError::invalid(
            "previous_response_id",
            "lily stores no responses: send the whole conversation as `input`.",
        ));
    }
    if body.get("background") == Some(&Value::Bool(true)) {
        return Err(ApiError::invalid(
            "background",
            "Background responses are not supported.",
        ));
    }
    if let Some(m) = body.get("max_output_tokens").filter(|m| !m.is_null()) {
        chat.insert("max_completion_tokens".into(), m.clone());
    }
    if includes_logprobs(body)? {
        chat.insert("logprobs".into(), Value::Bool(true));
        if let Some(k) = body.get("top_logprobs").filter(|k| !k.is_null()) {
            chat.insert("top_logprobs".into(), k.clone());
        }
    }
    chat.insert("messages".into(), Value::Array(messages(body)?));
    if let Some(tools) = body.get("tools").filter(|t| !t.is_null()) {
        chat.insert("tools".into(), chat_tools(tools)?);
    }
    if let Some(choice) = body.get("tool_choice").filter(|t| !t.is_null()) {
        chat.insert("tool_choice".into(), chat_tool_choice(choice)?);
    }
    if let Some(format) = body.get("text").and_then(|t| t.get("format")) {
        chat.insert("response_format".into(), response_format(format)?);
    }
    // Qwen thinks or not: chat reads an effort of "none" as thinking off.
    if let Some(effort) = body.get("reasoning").and_then(|r| r.get("effort"))
        && !effort.is_null()
    {
        chat.insert("reasoning_effort".into(), effort.clone());
    }
    Ok(Value::Object(chat))
}

/// Whether `include` asks for the message's log-probabilities (as OpenAI, `top_logprobs` alone
/// asks for nothing). The other values name output lily does not make, and are let pass.
fn includes_logprobs(body: &Value) -> Result<bool, ApiError> {
    let bad = || ApiError::invalid("include", "`include` is an array of strings.");
    match body.get("include") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Array(values)) => {
            let mut found = false;
            for v in values {
                found |= v.as_str().ok_or_else(bad)? == "message.output_text.logprobs";
            }
            Ok(found)
        }
        Some(_) => Err(bad()),
    }
}

/// `instructions` and `input` as chat messages: input messages as they are (text parts only),
/// function calls gathered into the assistant message they follow, their outputs as tool
/// messages, and reasoning items as the next assistant message's `reasoning_content`.
fn messages(body: &Value) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    match body.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.push(json!({"role": "system", "content": s})),
        Some(_) => {
            return Err(ApiError::invalid(
                "instructions",
                "`instructions` is a string.",
            ));
        }
    }
    let items = match body.get("input") {
        Some(Value::String(text)) => {
            out.push(json!({"role": "user", "content": text}));
            return Ok(out);
        }
        Some(Value::Array(items)) if !items.is_empty() => items,
        _ => {
            return Err(ApiError::invalid(
                "input",
                "`input` is a string or a non-empty list of items.",
            ));
        }
    };
    let bad = |i: usize, what: String| {
        let mut e = ApiError::invalid(None, format!("`input[{i}]`: {what}"));
        e.param = Some(format!("input[{i}]"));
        e
    };
    let mut reasoning: Option<String> = None;
    // The assistant message that function calls join, while nothing else has come between.
    let mut open_assistant: Option<usize> = None;
    for (i, item) in items.iter().enumerate() {
        let kind = item
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("message");
        match kind {
            "message" => {
                let role = item["role"]
                    .as_str()
                    .ok_or_else(|| bad(i, "a message needs a `role`".into()))?;
                let content = message_text(&item["content"]).map_err(|e| bad(i, e))?;
                let mut message = json!({"role": role, "content": content});
                if role == "assistant" {
                    if let Some(r) = reasoning.take() {
                        message["reasoning_content"] = Value::String(r);
                    }
                    open_assistant = Some(out.len());
                } else {
                    open_assistant = None;
                }
                out.push(message);
            }
            "function_call" => {
                let (Some(name), Some(arguments)) =
                    (item["name"].as_str(), item["arguments"].as_str())
                else {
                    return Err(bad(
                        i,
                        "a function call needs `name` and `arguments`".into(),
                    ));
                };
                let call = json!({
                    "id": item["call_id"].as_str().unwrap_or_default(),
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                });
                let at = match open_assistant {
                    Some(at) => at,
                    None => {
                        let mut message = json!({"role": "assistant", "content": null});
                        if let Some(r) = reasoning.take() {
                            message["reasoning_content"] = Value::String(r);
                        }
                        out.push(message);
                        open_assistant = Some(out.len() - 1);
                        out.len() - 1
                    }
                };
                let calls = out[at]
                    .as_object_mut()
                    .expect("a message is an object")
                    .entry("tool_calls")
                    .or_insert_with(|| json!([]));
                if let Some(calls) = calls.as_array_mut() {
                    calls.push(call);
                }
            }
            "function_call_output" => {
                let output = match &item["output"] {
                    Value::String(s) => s.clone(),
                    parts => message_text(parts).map_err(|e| bad(i, e))?,
                };
                out.push(json!({
                    "role": "tool",
                    "tool_call_id": item["call_id"].as_str().unwrap_or_default(),
                    "content": output,
                }));
                open_assistant = None;
            }
            "reasoning" => {
                let text: Vec<&str> = ["content", "summary"]
                    .iter()
                    .filter_map(|k| item[*k].as_array())
                    .find(|parts| !parts.is_empty())
                    .into_iter()
                    .flatten()
                    .filter_map(|p| p["text"].as_str())
                    .collect();
                reasoning
                    .get_or_insert_with(String::new)
                    .push_str(&text.join("\n"));
            }
            other => {
                return Err(bad(
                    i,
                    format!(
                        "input items of type `{other}` are not supported (messages, function \
                         calls and their outputs, reasoning)"
                    ),
                ));
            }
        }
    }
    // Qwen's template takes one system message, first: `instructions` and the input's own.
    if body.get("instructions").is_some_and(Value::is_string)
        && out.len() > 1
        && matches!(out[1]["role"].as_str(), Some("system" | "developer"))
    {
        let own = out.remove(1);
        let merged = format!(
            "{}\n\n{}",
            out[0]["content"].as_str().unwrap_or_default(),
            own["content"].as_str().unwrap_or_default()
        );
        out[0]["content"] = Value::String(merged);
    }
    Ok(out)
}

/// A message's content as text: a string, or the text of its text parts.
fn message_text(content: &Value) -> Result<String, String> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => parts
            .iter()
            .map(|part| match part["type"].as_str() {
                Some("input_text" | "output_text" | "text" | "refusal") => part["text"]
                    .as_str()
                    .or(part["refusal"].as_str())
                    .map(str::to_owned)
                    .ok_or_else(|| "a text part needs its `text`".to_owned()),
                Some(other) => Err(format!(
                    "content parts of type `{other}` are not supported (only text)"
                )),
                None => Err("a content part needs a `type`".to_owned()),
            })
            .collect(),
        _ => Err("`content` is a string or a list of parts".to_owned()),
    }
}

/// Function tools in the chat form (`{"type": "function", "function": {...}}`).
fn chat_tools(tools: &Value) -> Result<Value, ApiError> {
    let tools = tools
        .as_array()
        .ok_or_else(|| ApiError::invalid("tools", "`tools` is a list."))?;
    tools
        .iter()
        .map(|tool| match tool["type"].as_str() {
            Some("function") => {
                let mut function = tool.clone();
                if let Some(f) = function.as_object_mut() {
                    f.remove("type");
                }
                Ok(json!({"type": "function", "function": function}))
            }
            other => Err(ApiError::invalid(
                "tools",
                format!(
                    "Tools of type `{}` are not supported (only `function`).",
                    other.unwrap_or("?")
                ),
            )),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

fn chat_tool_choice(choice: &Value) -> Result<Value, ApiError> {
    match choice {
        Value::String(_) => Ok(choice.clone()),
        _ if choice["type"] == "function" && choice["name"].is_string() => {
            Ok(json!({"type": "function", "function": {"name": choice["name"]}}))
        }
        _ => Err(ApiError::invalid(
            "tool_choice",
            "`tool_choice` is \"auto\", \"none\", \"required\" or {\"type\": \"function\", \
             \"name\": ...}.",
        )),
    }
}

/// `text.format` as the chat request's `response_format`.
fn response_format(format: &Value) -> Result<Value, ApiError> {
    match format["type"].as_str() {
        Some("text") => Ok(json!({"type": "text"})),
        Some("json_object") => Ok(json!({"type": "json_object"})),
        Some("json_schema") => Ok(json!({"type": "json_schema", "json_schema": {
            "name": format["name"], "schema": format["schema"], "strict": format["strict"],
        }})),
        _ => Err(ApiError::invalid(
            "text.format",
            "`text.format` is of type `text`, `json_object` or `json_schema`.",
        )),
    }
}

/// A chat request's error, naming the Responses field it came from.
fn responses_param(mut e: ApiError) -> ApiError {
    // Chat's messages are made from `instructions` and `input`, so an index into them names no
    // input item: the field is named whole.
    let renamed = match e.param.as_deref() {
        Some(p) if p.starts_with("messages") => Some("input"),
        Some("max_completion_tokens") => Some("max_output_tokens"),
        Some(p) if p.starts_with("response_format") => Some("text.format"),
        Some("reasoning_effort") => Some("reasoning.effort"),
        _ => None,
    };
    if let Some(name) = renamed {
        e.param = Some(name.to_owned());
    }
    e
}

/// The request's settings a response repeats back.
fn echoed_fields(body: &Value) -> Map<String, Value> {
    let mut echo = Map::new();
    for (key, default) in [
        ("instructions", Value::Null),
        ("max_output_tokens", Value::Null),
        ("metadata", json!({})),
        ("parallel_tool_calls", Value::Bool(true)),
        ("temperature", Value::Null),
        ("top_p", Value::Null),
        ("tool_choice", json!("auto")),
        ("tools", json!([])),
        ("text", json!({"format": {"type": "text"}})),
        ("reasoning", json!({"effort": null, "summary": null})),
        ("top_logprobs", Value::Null),
    ] {
        let value = body.get(key).filter(|v| !v.is_null()).cloned();
        echo.insert(key.into(), value.unwrap_or(default));
    }
    echo.insert("store".into(), Value::Bool(false));
    echo.insert("truncation".into(), json!("disabled"));
    echo
}

/// The output item being streamed.
struct OpenItem {
    kind: TextItem,
    id: String,
    text: String,
    /// The log-probabilities of the message's tokens, when asked for.
    logprobs: Vec<Value>,
}

/// The output items streamed as text: the thought and the message.
#[derive(Clone, Copy, PartialEq, Eq)]
enum TextItem {
    Reasoning,
    Message,
}

impl TextItem {
    fn id_prefix(self) -> &'static str {
        match self {
            TextItem::Reasoning => "rs",
            TextItem::Message => "msg",
        }
    }

    /// The item with `text` (and its tokens' `logprobs`) as its content; `None`: just opened,
    /// no content part yet.
    fn item(self, id: &str, text: Option<(&str, &[Value])>) -> Value {
        match self {
            TextItem::Reasoning => {
                let content: Vec<Value> = text
                    .map(|(t, _)| json!({"type": "reasoning_text", "text": t}))
                    .into_iter()
                    .collect();
                json!({"id": id, "type": "reasoning", "summary": [], "content": content})
            }
            TextItem::Message => {
                let content: Vec<Value> = text
                    .map(|(t, logprobs)| output_text(t, logprobs))
                    .into_iter()
                    .collect();
                let status = if text.is_some() {
                    "completed"
                } else {
                    "in_progress"
                };
                json!({"id": id, "type": "message", "status": status, "role": "assistant",
                       "content": content})
            }
        }
    }

    /// The events of its text's deltas and of its end: `response.<name>.delta` / `.done`.
    fn text_event(self, done: bool) -> &'static str {
        match (self, done) {
            (TextItem::Reasoning, false) => "response.reasoning_text.delta",
            (TextItem::Reasoning, true) => "response.reasoning_text.done",
            (TextItem::Message, false) => "response.output_text.delta",
            (TextItem::Message, true) => "response.output_text.done",
        }
    }

    /// Fields of its text events beside the text: output text carries its tokens' logprobs
    /// (empty unless asked for).
    fn text_fields(self, id: &str, index: usize, logprobs: &[Value]) -> Value {
        let mut fields = json!({"item_id": id, "output_index": index, "content_index": 0});
        if self == TextItem::Message {
            fields["logprobs"] = json!(logprobs);
        }
        fields
    }
}

/// A response being assembled from the engine's events of its one choice. The same events are
/// written whole or streamed: `events` collects the stream's, which a whole reply drops.
struct ResponseReply {
    id: String,
    created_at: u64,
    model: String,
    echo: Map<String, Value>,
    choice: ChoiceOutput,
    prompt_tokens: usize,
    cached_tokens: usize,
    completion_tokens: usize,
    /// Tokens that added reasoning (the thought).
    reasoning_tokens: usize,
    /// Finished output items.
    output: Vec<Value>,
    open: Option<OpenItem>,
    /// The log-probabilities of tokens whose text is held back (it may open a tool call or
    /// close the thought): they go to the message if their text lands there.
    pending_logprobs: Vec<Value>,
    tokenizer: Arc<Tokenizer>,
    events: Vec<SseChunk>,
    sequence: usize,
    /// `completed` or `incomplete`, once finished.
    status: Option<&'static str>,
    started: Instant,
}

impl ResponseReply {
    /// A response to a prompt of `prompt_tokens`, nothing generated yet.
    fn new(
        model: &str,
        echo: Map<String, Value>,
        choice: ChoiceOutput,
        prompt_tokens: usize,
        tokenizer: Arc<Tokenizer>,
    ) -> Self {
        Self {
            id: format!("resp_{}", uuid::Uuid::new_v4().simple()),
            created_at: unix_now(),
            model: model.to_owned(),
            echo,
            choice,
            prompt_tokens,
            cached_tokens: 0,
            completion_tokens: 0,
            reasoning_tokens: 0,
            output: Vec::new(),
            open: None,
            pending_logprobs: Vec::new(),
            tokenizer,
            events: Vec::new(),
            sequence: 0,
            status: None,
            started: Instant::now(),
        }
    }

    fn emit(&mut self, kind: &'static str, mut fields: Value) {
        fields["type"] = json!(kind);
        fields["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        self.events
            .push(SseChunk::event(kind, stream::chunk(&fields)));
    }

    /// The response object as it stands.
    fn response(&self, status: &str) -> Value {
        let mut r = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": self.output,
            "error": null,
            "incomplete_details": null,
            "usage": null,
        });
        for (k, v) in &self.echo {
            r[k] = v.clone();
        }
        if status == "incomplete" {
            r["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        if matches!(status, "completed" | "incomplete") {
            r["usage"] = serde_json::to_value(self.usage()).unwrap_or(Value::Null);
        }
        r
    }

    fn usage(&self) -> Value {
        json!({
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        })
    }

    fn start_if_first(&mut self) {
        if self.sequence == 0 {
            let response = self.response("in_progress");
            self.emit("response.created", json!({"response": response}));
            self.emit("response.in_progress", json!({"response": response}));
        }
    }

    /// Applies an engine event: the stream events it makes go to `events`.
    fn apply(&mut self, event: Event) -> Result<(), ApiError> {
        self.start_if_first();
        match event {
            Event::Token { id, text, logprobs } => {
                if let Some(l) = logprobs {
                    let entry = serde_json::to_value(token_logprob(&self.tokenizer, id, &l));
                    self.pending_logprobs.push(entry.unwrap_or(Value::Null));
                }
                let delta = self.choice.push(&text, false);
                // A token whose text is held back belongs to the item being written.
                let thinking = match (&delta.reasoning_content, &delta.content) {
                    (Some(_), None) => true,
                    (None, None) if delta.tool_calls.is_empty() => self
                        .open
                        .as_ref()
                        .is_some_and(|o| o.kind == TextItem::Reasoning),
                    _ => false,
                };
                self.reasoning_tokens += usize::from(thinking);
                self.apply_delta(delta);
            }
            Event::Finished {
                reason,
                completion_tokens,
                cached_tokens,
            } => {
                let delta = self.choice.push("", true);
                self.apply_delta(delta);
                self.close_open();
                self.completion_tokens = completion_tokens;
                self.cached_tokens = cached_tokens;
                let status = match reason {
                    FinishReason::Length => "incomplete",
                    FinishReason::Stop => "completed",
                };
                self.status = Some(status);
                let response = self.response(status);
                self.emit(
                    if status == "completed" {
                        "response.completed"
                    } else {
                        "response.incomplete"
                    },
                    json!({"response": response}),
                );
            }
            // Responses ask for no prompt scores.
            Event::PromptLogprobs(_) => {}
            Event::Failed(message) => return Err(ApiError::internal(message)),
        }
        Ok(())
    }

    /// Adds a delta's text and calls to the output. The held-back tokens' logprobs go with its
    /// message text; a delta of only thought or calls shows they were not the message's.
    fn apply_delta(&mut self, delta: AssistantMessage) {
        if let Some(text) = delta.reasoning_content {
            self.push_text(TextItem::Reasoning, text, Vec::new());
        }
        if let Some(text) = delta.content {
            let logprobs = std::mem::take(&mut self.pending_logprobs);
            self.push_text(TextItem::Message, text, logprobs);
        } else if !delta.tool_calls.is_empty()
            || self
                .open
                .as_ref()
                .is_some_and(|o| o.kind == TextItem::Reasoning)
        {
            // Text held back inside the thought (`</think>` and the newlines after it) is
            // counted with the thought, as `reasoning_tokens` counts it.
            self.pending_logprobs.clear();
        }
        for call in delta.tool_calls {
            self.close_open();
            let index = self.output.len();
            let id = format!("fc_{}", uuid::Uuid::new_v4().simple());
            let arguments = call.function.arguments;
            let mut item = json!({"id": id, "type": "function_call", "status": "in_progress",
                                  "call_id": call.id, "name": call.function.name,
                                  "arguments": ""});
            self.emit(
                "response.output_item.added",
                json!({"output_index": index, "item": item}),
            );
            self.emit(
                "response.function_call_arguments.delta",
                json!({"item_id": id, "output_index": index, "delta": arguments}),
            );
            self.emit(
                "response.function_call_arguments.done",
                json!({"item_id": id, "output_index": index, "arguments": arguments}),
            );
            item["arguments"] = json!(arguments);
            item["status"] = json!("completed");
            self.emit(
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
            );
            self.output.push(item);
        }
    }

    /// Adds text (and its tokens' logprobs) to the item of its kind, opening it (and closing
    /// any other) first.
    fn push_text(&mut self, kind: TextItem, text: String, logprobs: Vec<Value>) {
        if self.open.as_ref().map(|o| o.kind) != Some(kind) {
            self.close_open();
        }
        // Closing an item moved it to `output`: the open one's index is what follows.
        let index = self.output.len();
        if self.open.is_none() {
            let id = format!("{}_{}", kind.id_prefix(), uuid::Uuid::new_v4().simple());
            self.emit(
                "response.output_item.added",
                json!({"output_index": index, "item": kind.item(&id, None)}),
            );
            if kind == TextItem::Message {
                self.emit(
                    "response.content_part.added",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "part": output_text("", &[])}),
                );
            }
            self.open = Some(OpenItem {
                kind,
                id,
                text: String::new(),
                logprobs: Vec::new(),
            });
        }
        let Some(open) = &mut self.open else {
            return;
        };
        open.text.push_str(&text);
        let mut fields = kind.text_fields(&open.id, index, &logprobs);
        open.logprobs.extend(logprobs);
        fields["delta"] = json!(text);
        self.emit(kind.text_event(false), fields);
    }

    /// Finishes the item being streamed, if any.
    fn close_open(&mut self) {
        let index = self.output.len();
        let Some(OpenItem {
            kind,
            id,
            text,
            logprobs,
        }) = self.open.take()
        else {
            return;
        };
        let mut fields = kind.text_fields(&id, index, &logprobs);
        fields["text"] = json!(text);
        self.emit(kind.text_event(true), fields);
        if kind == TextItem::Message {
            self.emit(
                "response.content_part.done",
                json!({"item_id": id, "output_index": index, "content_index": 0,
                       "part": output_text(&text, &logprobs)}),
            );
        }
        let item = kind.item(&id, Some((&text, &logprobs)));
        self.emit(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
        self.output.push(item);
    }

    fn log(&self) {
        let usage = Usage::new(
            self.prompt_tokens,
            self.completion_tokens,
            self.cached_tokens,
        );
        log_answered(&self.id, &usage, &[self.status], self.started);
    }
}

fn output_text(text: &str, logprobs: &[Value]) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs})
}

impl ChunkWriter for ResponseReply {
    fn on_start(&mut self) -> Vec<SseChunk> {
        self.start_if_first();
        std::mem::take(&mut self.events)
    }

    fn on_event(&mut self, _: usize, event: Event) -> Result<Vec<SseChunk>, ApiError> {
        self.apply(event)?;
        Ok(std::mem::take(&mut self.events))
    }

    fn on_end(&mut self) -> Vec<SseChunk> {
        self.log();
        Vec::new()
    }

    fn on_error(&mut self, error: ApiError) -> Vec<SseChunk> {
        self.start_if_first();
        let mut response = self.response("failed");
        response["error"] = json!({"code": "server_error", "message": error.message});
        self.emit("response.failed", json!({"response": response}));
        std::mem::take(&mut self.events)
    }

    fn ends_with_done(&self) -> bool {
        false
    }
}

impl stream::Reply for ResponseReply {
    type Whole = Value;

    fn record(&mut self, _: usize, event: Event) -> Result<(), ApiError> {
        self.apply(event)?;
        self.events.clear();
        Ok(())
    }

    fn whole(self) -> Value {
        self.log();
        self.response(self.status.unwrap_or("incomplete"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sampler::TokenLogprob;
    use crate::engine::scheduler::TokenLogprobs;

    #[test]
    fn input_items_become_chat_messages() {
        let body = json!({
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                 "text": "Call the tool."}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather",
                 "arguments": "{\"city\": \"Paris\"}"},
                {"type": "function_call", "call_id": "c2", "name": "get_weather",
                 "arguments": "{\"city\": \"Rome\"}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "function_call_output", "call_id": "c2",
                 "output": [{"type": "input_text", "text": "rain"}]},
                {"type": "message", "role": "assistant",
                 "content": [{"type": "output_text", "text": "Sunny, then rain."}]},
                {"role": "user", "content": "Thanks"},
            ],
            "max_output_tokens": 64,
            "tools": [{"type": "function", "name": "get_weather", "parameters": {}}],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "reasoning": {"effort": "none"},
            "store": false,
        });
        let chat = chat_request(&body).unwrap();
        assert_eq!(
            chat["messages"],
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": null, "reasoning_content": "Call the tool.",
                 "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                     "arguments": "{\"city\": \"Paris\"}"}},
                    {"id": "c2", "type": "function", "function": {"name": "get_weather",
                     "arguments": "{\"city\": \"Rome\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "c2", "content": "rain"},
                {"role": "assistant", "content": "Sunny, then rain."},
                {"role": "user", "content": "Thanks"},
            ])
        );
        assert_eq!(chat["max_completion_tokens"], 64);
        assert_eq!(
            chat["tools"],
            json!([{"type": "function", "function": {"name": "get_weather", "parameters": {}}}])
        );
        assert_eq!(
            chat["tool_choice"],
            json!({"type": "function", "function": {"name": "get_weather"}})
        );
        assert_eq!(chat["response_format"]["type"], "json_schema");
        assert_eq!(chat["reasoning_effort"], "none");
    }

    /// A reply to nothing in particular, sorted as `choice` says.
    fn reply(choice: ChoiceOutput) -> ResponseReply {
        let tokenizer = Arc::new(crate::model::demo::demo().unwrap().tokenizer);
        ResponseReply::new("m", echoed_fields(&json!({})), choice, 3, tokenizer)
    }

    /// The events a reply makes, each event's JSON. Token i (id i) has logprob -(i + 1) when
    /// `choice` was made with logprobs.
    fn streamed(reply: &mut ResponseReply, texts: &[&str]) -> Vec<Value> {
        let mut chunks = reply.on_start();
        for (id, text) in texts.iter().enumerate() {
            let token = Event::Token {
                id: id as u32,
                text: (*text).to_owned(),
                logprobs: Some(TokenLogprobs {
                    logprob: -(id as f32 + 1.0),
                    top: vec![TokenLogprob {
                        token_id: 7,
                        logprob: -0.5,
                    }],
                }),
            };
            chunks.extend(reply.on_event(0, token).unwrap());
        }
        let end = Event::Finished {
            reason: FinishReason::Stop,
            completion_tokens: texts.len(),
            cached_tokens: 0,
        };
        chunks.extend(reply.on_event(0, end).unwrap());
        chunks
            .iter()
            .map(|c| {
                let event: Value = serde_json::from_str(&c.data).unwrap();
                assert_eq!(c.event, event["type"].as_str());
                event
            })
            .collect()
    }

    #[test]
    fn a_thought_a_message_and_a_call_stream_as_three_items() {
        let tools =
            serde_json::from_value(json!([{"type": "function", "function": {"name": "f"}}]))
                .unwrap();
        let mut reply = reply(ChoiceOutput::sorting(true, Some(tools), Some(1)));
        let texts = [
            "Let me ",
            "think.",
            "\n</think>",
            "\n\nHi ",
            "there.",
            "\n<tool_call>\n<function=f>\n</function>\n</tool_call>",
        ];
        let events = streamed(&mut reply, &texts);
        let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (i, e) in events.iter().enumerate() {
            assert_eq!(e["sequence_number"], i);
        }
        let index = |from: usize, to: usize| -> Vec<u64> {
            events[from..to]
                .iter()
                .map(|e| e["output_index"].as_u64().unwrap())
                .collect()
        };
        assert_eq!(index(2, 7), [0; 5]);
        assert_eq!(index(7, 14), [1; 7]);
        assert_eq!(index(14, 18), [2; 4]);
        assert_eq!(events[5]["text"], "Let me think.");
        assert_eq!(events[11]["text"], "Hi there.");
        let output = &events[18]["response"]["output"];
        assert_eq!(output[0]["content"][0]["text"], "Let me think.");
        assert_eq!(output[1]["content"][0]["text"], "Hi there.");
        assert_eq!(output[1]["status"], "completed");
        assert_eq!(output[2]["name"], "f");
        assert_eq!(
            events[18]["response"]["usage"]["output_tokens_details"]["reasoning_tokens"],
            3
        );
        // Only the message's tokens carry logprobs: not the thought's, the `</think>` token's
        // or the call's; each delta its own, the text's end and the output all of them.
        let logprobs = |e: &Value| -> Vec<f64> {
            e.as_array()
                .unwrap()
                .iter()
                .map(|l| l["logprob"].as_f64().unwrap())
                .collect()
        };
        assert_eq!(logprobs(&events[9]["logprobs"]), [-4.0]);
        assert_eq!(logprobs(&events[10]["logprobs"]), [-5.0]);
        assert_eq!(logprobs(&events[11]["logprobs"]), [-4.0, -5.0]);
        assert_eq!(logprobs(&output[1]["content"][0]["logprobs"]), [-4.0, -5.0]);
        let first = &output[1]["content"][0]["logprobs"][0];
        assert_eq!(first["top_logprobs"][0]["logprob"], -0.5);
        assert!(first["token"].is_string() && first["bytes"].is_array());
    }

    #[test]
    fn logprobs_are_asked_for_through_include() {
        let input = json!({"input": "Hi", "top_logprobs": 3});
        let chat = chat_request(&input).unwrap();
        assert!(chat.get("logprobs").is_none() && chat.get("top_logprobs").is_none());
        let mut asked = input.clone();
        asked["include"] = json!([
            "reasoning.encrypted_content",
            "message.output_text.logprobs"
        ]);
        let chat = chat_request(&asked).unwrap();
        assert_eq!(chat["logprobs"], true);
        assert_eq!(chat["top_logprobs"], 3);
        for bad in [json!("message.output_text.logprobs"), json!([1])] {
            asked["include"] = bad;
            assert_eq!(
                chat_request(&asked).unwrap_err().param.as_deref(),
                Some("include")
            );
        }
    }

    #[test]
    fn instructions_and_the_inputs_system_message_make_one() {
        let body = json!({"instructions": "Be brief.", "input": [
            {"role": "developer", "content": "Use metric units."},
            {"role": "user", "content": "Hi"},
        ]});
        assert_eq!(
            chat_request(&body).unwrap()["messages"],
            json!([
                {"role": "system", "content": "Be brief.\n\nUse metric units."},
                {"role": "user", "content": "Hi"},
            ])
        );
    }

    #[test]
    fn what_cannot_be_served_is_refused_naming_the_field() {
        for (body, param) in [
            (
                json!({"input": "x", "previous_response_id": "resp_1"}),
                "previous_response_id",
            ),
            (json!({"input": []}), "input"),
            (json!({"input": 5}), "input"),
            (
                json!({"input": [{"type": "item_reference", "id": "x"}]}),
                "input[0]",
            ),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
                "input[0]",
            ),
            (
                json!({"input": "x", "tools": [{"type": "web_search"}]}),
                "tools",
            ),
            (
                json!({"input": "x", "text": {"format": {"type": "xml"}}}),
                "text.format",
            ),
            (
                json!({"input": "x", "tool_choice": {"type": "mcp"}}),
                "tool_choice",
            ),
            (json!({"input": "x", "instructions": 3}), "instructions"),
            (json!({"input": "x", "background": true}), "background"),
        ] {
            let e = chat_request(&body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
    }
}

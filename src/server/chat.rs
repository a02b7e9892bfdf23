//! `POST /v1/chat/completions`: a conversation rendered with the model's chat template,
//! generated, and answered as a chat completion (whole, or streamed as chunks) with the reply
//! split into `reasoning_content`, `content` and `tool_calls`. A `response_format` schema or a
//! forced `tool_choice` becomes a grammar the reply is sampled under. [`queue_chat`] (checking,
//! rendering, queueing) and [`ChoiceOutput`] (sorting the reply) serve the Responses API too.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::Response;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use super::errors::{ApiError, JsonObject, fields_and_unread, warn_unread};
use super::generation::{
    MAX_TOP_LOGPROBS, Plan, Shape, log_answered, merged_events, off_the_workers,
};
use super::openai::{
    AssistantMessage, ChatChoice, ChatCompletion, ChatFields, ChatLogprobs, ChatMessage,
    ChatTokenLogprob, ChatTopLogprob, CommonFields, FunctionCallOut, MessageContent, ReplyMessage,
    ResponseFormat, Tool, ToolCallOut, ToolChoice, Usage,
};
use super::reasoning::ReasoningSplitter;
use super::stream::{self, ChunkWriter, SseChunk, chunk, respond};
use super::tool_calls::{ParsedCall, ToolCallParser, forced_calls_grammar};
use super::{AppState, unix_now};
use crate::engine::constraint::json_style;
use crate::engine::generate::FinishReason;
use crate::engine::scheduler::{Event, TokenLogprobs};
use crate::text::tokenizer::Tokenizer;

pub async fn chat_completions(
    State(app): State<Arc<AppState>>,
    JsonObject(body): JsonObject,
) -> Result<Response, ApiError> {
    let queued = queue_chat(&app, body).await?;
    let stream = queued.plan.stream;
    let reply = Reply {
        id: format!("chatcmpl-{}", uuid::Uuid::new_v4().simple()),
        created: unix_now(),
        model: app.model.name().to_owned(),
        tokenizer: queued.tokenizer.clone(),
        prompt_tokens: queued.prompt.len(),
        prompt_ids: queued
            .plan
            .return_token_ids
            .then_some(queued.prompt.clone()),
        choices: (0..queued.plan.n)
            .map(|_| ChoiceOutput::new(&queued))
            .collect(),
        include_usage: queued.plan.include_usage,
        return_token_ids: queued.plan.return_token_ids,
        started: Instant::now(),
    };
    respond(merged_events(queued.receivers), reply, stream).await
}

/// A chat request checked, rendered and queued in the engine: what a reply is assembled from.
pub struct QueuedChat {
    pub receivers: Vec<UnboundedReceiver<Event>>,
    pub plan: Plan,
    pub prompt: Vec<u32>,
    /// The prompt opens a thought, so the reply starts as reasoning.
    pub opens_thought: bool,
    pub tools: Vec<Tool>,
    /// Whether tool-call blocks in the reply become tool calls.
    pub parse_tool_calls: bool,
    pub logprobs: Option<usize>,
    pub tokenizer: Arc<Tokenizer>,
}

/// Checks a chat completion request, renders its conversation and queues its choices.
pub async fn queue_chat(app: &Arc<AppState>, body: Value) -> Result<QueuedChat, ApiError> {
    let (common, common_unread) = fields_and_unread::<CommonFields>(&body)?;
    let (chat, chat_unread) = fields_and_unread::<ChatFields>(&body)?;
    warn_unread("/v1/chat/completions", &[common_unread, chat_unread]);
    let max_tokens = match (chat.max_completion_tokens, common.max_tokens) {
        (Some(m), _) => Some((m, "max_completion_tokens")),
        (None, Some(m)) => Some((m, "max_tokens")),
        (None, None) => None,
    };
    let mut plan = Plan::read(common, max_tokens, app)?;
    let (Some(tokenizer), Some(template)) = (&app.model.tokenizer, &app.model.chat_template) else {
        return Err(ApiError::invalid(
            "messages",
            "This model has no tokenizer (tokenizer.json), so it cannot chat; use \
             /v1/completions with token-id prompts.",
        ));
    };
    let json_schema = json_schema_of(chat.response_format)?;
    let logprobs = match (chat.logprobs.unwrap_or(false), chat.top_logprobs) {
        (false, None | Some(0)) => None,
        (false, Some(_)) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "`top_logprobs` needs `logprobs: true`.",
            ));
        }
        (true, None) => Some(0),
        (true, Some(k)) if (0..=MAX_TOP_LOGPROBS).contains(&k) => Some(k as usize),
        (true, Some(k)) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}, got {k}."),
            ));
        }
    };
    let tools = chat.tools.unwrap_or_default();
    if let Some(tool) = tools.iter().find(|t| t.kind != "function") {
        return Err(ApiError::invalid(
            "tools",
            format!(
                "Tool type `{}` is not supported (only `function`).",
                tool.kind
            ),
        ));
    }
    let forced_call = forced_call_of(chat.tool_choice.as_ref(), &tools)?;
    let parse_tool_calls = match &chat.tool_choice {
        Some(ToolChoice::Mode(mode)) if mode == "none" => false,
        _ => !tools.is_empty(),
    };

    let context = template_context(
        &body,
        chat.messages,
        chat.chat_template_kwargs,
        chat.reasoning_effort.as_deref(),
    )?;
    let (template, encoder) = (template.clone(), tokenizer.clone());
    let grammar_app = app.clone();
    let parallel = chat.parallel_tool_calls.unwrap_or(true);
    // One call at most: the reply ends with the first call's closing tag (a single token in
    // Qwen's vocabulary; a tokenizer without it as one token leaves the reply unbounded).
    if parse_tool_calls && !parallel && forced_call.is_none() {
        plan.end_after_ids
            .extend(tokenizer.token_id("</tool_call>"));
    }
    let forced_grammar = forced_call
        .map(|only| forced_calls_grammar(&tools, only.as_deref(), parallel, &json_style()));
    let (prompt_text, prompt, constraint) = off_the_workers(move || {
        let text = template
            .render(&Value::Object(context))
            .map_err(|e| ApiError::invalid("messages", format!("{e:#}")))?;
        let ids = encoder
            .encode(&text)
            .map_err(|e| ApiError::invalid("messages", format!("{e:#}")))?;
        // A forced call leaves no content for `response_format` to shape (as OpenAI's API has it).
        let shape = match (forced_grammar, json_schema) {
            (Some(grammar), _) => Some(Shape::Calls(grammar)),
            (None, Some(schema)) => Some(Shape::Json(schema)),
            (None, None) => None,
        };
        let constraint = match shape {
            None => None,
            Some(shape) => {
                let constraint = shape.constraint(&grammar_app)?;
                // With the thought open the grammar starts where it closes.
                Some(if opens_thought(&text) {
                    constraint.after_thought()
                } else {
                    constraint
                })
            }
        };
        Ok((text, ids, constraint))
    })
    .await?;
    let budget = plan.token_budget(prompt.len(), "messages", app)?;
    let cache_points = message_starts(&prompt, tokenizer.token_id("<|im_start|>"));
    let receivers = plan.submit(
        app,
        &prompt,
        &cache_points,
        budget,
        logprobs,
        constraint.as_ref(),
    )?;
    Ok(QueuedChat {
        receivers,
        plan,
        prompt,
        opens_thought: opens_thought(&prompt_text),
        tools,
        parse_tool_calls,
        logprobs,
        tokenizer: tokenizer.clone(),
    })
}

/// The schema `response_format` holds the reply to: `Some(schema)` structured output,
/// `Some(None)` any JSON object, `None` free text.
pub fn json_schema_of(format: Option<ResponseFormat>) -> Result<Option<Option<Value>>, ApiError> {
    Ok(match format {
        None => None,
        Some(format) => match (format.kind.as_str(), format.json_schema) {
            ("text", _) => None,
            ("json_object", _) => Some(None),
            ("json_schema", Some(spec)) => Some(spec.schema),
            ("json_schema", None) => {
                return Err(ApiError::invalid(
                    "response_format",
                    "`response_format` of type `json_schema` needs a `json_schema` object.",
                ));
            }
            (other, _) => {
                return Err(ApiError::invalid(
                    "response_format",
                    format!(
                        "response_format `{other}` is not supported (`text`, `json_object`, \
                         `json_schema`)."
                    ),
                ));
            }
        },
    })
}

/// The calls `tool_choice` forces: `Some(None)` any of the tools, `Some(Some(name))` that one.
fn forced_call_of(
    choice: Option<&ToolChoice>,
    tools: &[Tool],
) -> Result<Option<Option<String>>, ApiError> {
    let forced = match choice {
        None => None,
        Some(ToolChoice::Mode(mode)) if mode == "auto" || mode == "none" => None,
        Some(ToolChoice::Mode(mode)) if mode == "required" => Some(None),
        Some(ToolChoice::Mode(mode)) => {
            return Err(ApiError::invalid(
                "tool_choice",
                format!(
                    "`tool_choice` \"{mode}\" is not one of \"auto\", \"none\", \"required\" or \
                     {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}."
                ),
            ));
        }
        Some(ToolChoice::Named(named)) => match named["function"]["name"].as_str() {
            Some(name) if named["type"] == "function" => Some(Some(name.to_owned())),
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "A named `tool_choice` is {\"type\": \"function\", \"function\": {\"name\": \
                     NAME}}.",
                ));
            }
        },
    };
    if let Some(only) = &forced {
        let known = match only {
            None => !tools.is_empty(),
            Some(name) => tools.iter().any(|t| &t.function.name == name),
        };
        if !known {
            return Err(ApiError::invalid(
                "tool_choice",
                "`tool_choice` forces a call to a tool that `tools` does not list.",
            ));
        }
    }
    Ok(forced)
}

/// Whether the prompt leaves a thought open for the reply (Qwen's template with thinking on).
fn opens_thought(prompt_text: &str) -> bool {
    prompt_text.trim_end().ends_with("<think>")
}

/// Where the prompt is worth keeping in the prefix cache: where the first message after the
/// system block starts (other conversations with the same system prompt and tools share what is
/// before) and where the last one, the generation prompt, starts (the next turn of this
/// conversation repeats everything before it; what comes after, the opened assistant turn, is
/// rendered differently once the reply is in the history).
fn message_starts(prompt: &[u32], im_start: Option<u32>) -> Vec<usize> {
    let Some(im_start) = im_start else {
        return Vec::new();
    };
    let mut starts = prompt
        .iter()
        .enumerate()
        .filter(|&(i, &id)| i > 0 && id == im_start)
        .map(|(i, _)| i);
    let first = starts.next();
    first.into_iter().chain(starts.next_back()).collect()
}

/// The chat template's variables for a conversation: `chat_template_kwargs` (with a
/// `reasoning_effort` of `"none"` as `enable_thinking: false`), the messages, the request's
/// `tools` and `tool_choice` as given, and `add_generation_prompt` (true unless set).
pub fn template_context(
    body: &Value,
    messages: Vec<ChatMessage>,
    kwargs: Option<Map<String, Value>>,
    reasoning_effort: Option<&str>,
) -> Result<Map<String, Value>, ApiError> {
    let mut context = kwargs.unwrap_or_default();
    match reasoning_effort {
        None | Some("minimal" | "low" | "medium" | "high" | "xhigh") => {}
        Some("none") => {
            context
                .entry("enable_thinking")
                .or_insert(Value::Bool(false));
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "reasoning_effort",
                format!(
                    "`reasoning_effort` \"{other}\" is not one of \"none\", \"minimal\", \"low\", \
                     \"medium\", \"high\", \"xhigh\"."
                ),
            ));
        }
    }
    context.insert("messages".into(), template_messages(messages)?);
    if let Some(tools) = body
        .get("tools")
        .filter(|t| t.as_array().is_some_and(|a| !a.is_empty()))
    {
        context.insert("tools".into(), tools.clone());
    }
    if let Some(choice) = body.get("tool_choice") {
        context.insert("tool_choice".into(), choice.clone());
    }
    context
        .entry("add_generation_prompt")
        .or_insert(Value::Bool(true));
    Ok(context)
}

/// Messages as the template expects them: OpenAI's `developer` role as `system`, text parts
/// kept, and tool-call arguments (a JSON string in OpenAI's format) as objects.
fn template_messages(messages: Vec<ChatMessage>) -> Result<Value, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` is empty."));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, message) in messages.into_iter().enumerate() {
        let role = match message.role.as_str() {
            "developer" | "system" => "system",
            role @ ("user" | "assistant" | "tool") => role,
            other => {
                return Err(ApiError::invalid(
                    "messages",
                    format!("messages[{i}]: unknown role `{other}`."),
                ));
            }
        };
        let mut m = Map::new();
        m.insert("role".into(), role.into());
        let content = match message.content {
            None => Value::Null,
            Some(MessageContent::Text(text)) => Value::String(text),
            Some(MessageContent::Parts(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for part in parts {
                    match (part.kind.as_str(), part.text) {
                        ("text", Some(text)) => texts.push(json!({"type": "text", "text": text})),
                        (kind, _) => {
                            return Err(ApiError::invalid(
                                "messages",
                                format!(
                                    "messages[{i}]: content parts of type `{kind}` are not \
                                     supported (only `text` with a `text` field)."
                                ),
                            ));
                        }
                    }
                }
                Value::Array(texts)
            }
        };
        m.insert("content".into(), content);
        if let Some(name) = message.name {
            m.insert("name".into(), name.into());
        }
        if let Some(id) = message.tool_call_id {
            m.insert("tool_call_id".into(), id.into());
        }
        if let Some(reasoning) = message.reasoning_content {
            m.insert("reasoning_content".into(), reasoning.into());
        }
        if let Some(calls) = message.tool_calls {
            let calls = calls
                .into_iter()
                .map(|call| {
                    let arguments = match call.function.arguments {
                        Value::String(text) if text.trim().is_empty() => json!({}),
                        Value::String(text) => serde_json::from_str::<Value>(&text)
                            .ok()
                            .filter(Value::is_object)
                            .ok_or_else(|| {
                                ApiError::invalid(
                                    "messages",
                                    format!(
                                        "messages[{i}]: tool call arguments must be a JSON \
                                         object (as a string)."
                                    ),
                                )
                            })?,
                        Value::Null => json!({}),
                        other => other,
                    };
                    Ok(json!({
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": arguments},
                    }))
                })
                .collect::<Result<Vec<_>, ApiError>>()?;
            m.insert("tool_calls".into(), Value::Array(calls));
        }
        out.push(Value::Object(m));
    }
    Ok(Value::Array(out))
}

/// One choice's reply being assembled.
pub struct ChoiceOutput {
    splitter: ReasoningSplitter,
    /// Present when the request has tools and lets the model call them.
    tool_parser: Option<ToolCallParser>,
    tool_calls: usize,
    /// The whole reply so far (non-streaming responses).
    message: AssistantMessage,
    logprobs: Option<ChatLogprobs>,
    token_ids: Vec<u32>,
    finish: Option<&'static str>,
    completion_tokens: usize,
    /// Prompt tokens the engine took from its prefix cache.
    cached_tokens: usize,
}

impl ChoiceOutput {
    pub fn new(queued: &QueuedChat) -> Self {
        Self::sorting(
            queued.opens_thought,
            queued.parse_tool_calls.then(|| queued.tools.clone()),
            queued.logprobs,
        )
    }

    /// A reply that starts inside a thought if `opens_thought`, with tool calls parsed when
    /// `tools` are given, and logprobs kept when asked for.
    pub fn sorting(opens_thought: bool, tools: Option<Vec<Tool>>, logprobs: Option<usize>) -> Self {
        Self {
            splitter: ReasoningSplitter::new(opens_thought),
            tool_parser: tools.map(ToolCallParser::new),
            tool_calls: 0,
            message: AssistantMessage::default(),
            logprobs: logprobs.map(|_| ChatLogprobs::default()),
            token_ids: Vec::new(),
            finish: None,
            completion_tokens: 0,
            cached_tokens: 0,
        }
    }

    /// Sorts reply text into reasoning, content and tool calls: the delta it adds.
    pub fn push(&mut self, text: &str, end: bool) -> AssistantMessage {
        let mut split = self.splitter.push(text);
        if end {
            let rest = self.splitter.finish();
            split.reasoning.push_str(&rest.reasoning);
            split.content.push_str(&rest.content);
        }
        let mut delta = AssistantMessage::default();
        let (content, calls) = match &mut self.tool_parser {
            None => (split.content, Vec::new()),
            Some(parser) => {
                let mut parsed = parser.push(&split.content);
                if end {
                    let rest = parser.finish();
                    parsed.content.push_str(&rest.content);
                    parsed.calls.extend(rest.calls);
                }
                (parsed.content, parsed.calls)
            }
        };
        if !split.reasoning.is_empty() {
            delta.reasoning_content = Some(split.reasoning);
        }
        if !content.is_empty() {
            delta.content = Some(content);
        }
        delta.tool_calls = calls.into_iter().map(|call| self.tool_call(call)).collect();
        delta
    }

    fn tool_call(&mut self, call: ParsedCall) -> ToolCallOut {
        let index = self.tool_calls;
        self.tool_calls += 1;
        let id = uuid::Uuid::new_v4().simple().to_string();
        ToolCallOut {
            index: Some(index),
            id: format!("call_{}", &id[..24]),
            kind: "function",
            function: FunctionCallOut {
                name: call.name,
                arguments: Value::Object(call.arguments).to_string(),
            },
        }
    }

    pub fn made_calls(&self) -> bool {
        self.tool_parser
            .as_ref()
            .is_some_and(ToolCallParser::made_calls)
    }

    /// Adds a delta to the whole message.
    fn accumulate(&mut self, delta: &AssistantMessage) {
        let append = |into: &mut Option<String>, more: &Option<String>| {
            if let Some(more) = more {
                into.get_or_insert_with(String::new).push_str(more);
            }
        };
        append(
            &mut self.message.reasoning_content,
            &delta.reasoning_content,
        );
        append(&mut self.message.content, &delta.content);
        self.message
            .tool_calls
            .extend(delta.tool_calls.iter().map(|c| ToolCallOut {
                index: None,
                ..c.clone()
            }));
    }
}

/// A chat completion being assembled from engine events (whole or as a stream).
struct Reply {
    id: String,
    created: u64,
    model: String,
    tokenizer: Arc<Tokenizer>,
    prompt_tokens: usize,
    prompt_ids: Option<Vec<u32>>,
    choices: Vec<ChoiceOutput>,
    include_usage: bool,
    return_token_ids: bool,
    started: Instant,
}

/// What one event added to a choice.
struct Step {
    delta: AssistantMessage,
    logprobs: Option<ChatTokenLogprob>,
    finish: Option<&'static str>,
    token_id: Option<u32>,
}

impl Reply {
    /// Applies an event to its choice.
    fn step(&mut self, index: usize, event: Event) -> Result<Step, ApiError> {
        let tokenizer = self.tokenizer.clone();
        let choice = &mut self.choices[index];
        match event {
            Event::Token { id, text, logprobs } => {
                choice.token_ids.push(id);
                let delta = choice.push(&text, false);
                let logprobs = logprobs.map(|l| token_logprob(&tokenizer, id, &l));
                Ok(Step {
                    delta,
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
                let delta = choice.push("", true);
                choice.completion_tokens = completion_tokens;
                choice.cached_tokens = cached_tokens;
                let finish = match reason {
                    FinishReason::Stop if choice.made_calls() => "tool_calls",
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                };
                choice.finish = Some(finish);
                Ok(Step {
                    delta,
                    logprobs: None,
                    finish: Some(finish),
                    token_id: None,
                })
            }
            // Chat asks for no prompt scores (`Plan::prompt_logprobs` stays unset).
            Event::PromptLogprobs(_) => Ok(Step {
                delta: AssistantMessage::default(),
                logprobs: None,
                finish: None,
                token_id: None,
            }),
            Event::Failed(message) => Err(ApiError::internal(message)),
        }
    }

    fn log(&self) {
        let finishes: Vec<_> = self.choices.iter().map(|c| c.finish).collect();
        log_answered(&self.id, &self.usage(), &finishes, self.started);
    }

    fn usage(&self) -> Usage {
        Usage::new(
            self.prompt_tokens,
            self.choices.iter().map(|c| c.completion_tokens).sum(),
            self.choices
                .iter()
                .map(|c| c.cached_tokens)
                .max()
                .unwrap_or(0),
        )
    }

    fn envelope(&self, object: &'static str, choices: Vec<ChatChoice>) -> ChatCompletion {
        ChatCompletion {
            id: self.id.clone(),
            object,
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: None,
            prompt_token_ids: None,
        }
    }

    fn chunk_for(
        &self,
        index: usize,
        delta: AssistantMessage,
        step: Option<Step>,
    ) -> ChatCompletion {
        let (logprobs, finish, token_ids) = match step {
            Some(s) => (
                s.logprobs.map(|l| ChatLogprobs { content: vec![l] }),
                s.finish,
                s.token_id.map(|id| vec![id]),
            ),
            None => (None, None, None),
        };
        let mut c = self.envelope(
            "chat.completion.chunk",
            vec![ChatChoice {
                index,
                message: None,
                delta: Some(delta),
                logprobs,
                finish_reason: finish,
                token_ids: if self.return_token_ids {
                    Some(token_ids.unwrap_or_default())
                } else {
                    None
                },
            }],
        );
        if self.include_usage {
            c.usage = Some(None);
        }
        c
    }
}

impl stream::Reply for Reply {
    type Whole = ChatCompletion;

    fn record(&mut self, index: usize, event: Event) -> Result<(), ApiError> {
        let step = self.step(index, event)?;
        let choice = &mut self.choices[index];
        choice.accumulate(&step.delta);
        if let (Some(all), Some(one)) = (&mut choice.logprobs, step.logprobs) {
            all.content.push(one);
        }
        Ok(())
    }

    fn whole(mut self) -> ChatCompletion {
        self.log();
        let usage = self.usage();
        let return_token_ids = self.return_token_ids;
        let choices = std::mem::take(&mut self.choices)
            .into_iter()
            .enumerate()
            .map(|(index, c)| {
                let content = match c.message.content {
                    None if c.message.tool_calls.is_empty() => Some(String::new()),
                    content => content,
                };
                ChatChoice {
                    index,
                    message: Some(ReplyMessage {
                        role: "assistant",
                        content,
                        reasoning_content: c.message.reasoning_content,
                        tool_calls: c.message.tool_calls,
                    }),
                    delta: None,
                    logprobs: c.logprobs,
                    finish_reason: c.finish,
                    token_ids: return_token_ids.then_some(c.token_ids),
                }
            })
            .collect();
        let mut completion = self.envelope("chat.completion", choices);
        completion.usage = Some(Some(usage));
        completion.prompt_token_ids = self.prompt_ids.take();
        completion
    }
}

impl ChunkWriter for Reply {
    /// The first chunk of each choice, with the role (and the prompt ids, if asked for), goes
    /// out at once, before the prefill.
    fn on_start(&mut self) -> Vec<SseChunk> {
        (0..self.choices.len())
            .map(|index| {
                let delta = AssistantMessage {
                    role: Some("assistant"),
                    content: Some(String::new()),
                    ..Default::default()
                };
                let mut c = self.chunk_for(index, delta, None);
                c.prompt_token_ids = self.prompt_ids.clone();
                chunk(&c).into()
            })
            .collect()
    }

    fn on_event(&mut self, index: usize, event: Event) -> Result<Vec<SseChunk>, ApiError> {
        let mut step = self.step(index, event)?;
        let delta = std::mem::take(&mut step.delta);
        let empty = delta.content.is_none()
            && delta.reasoning_content.is_none()
            && delta.tool_calls.is_empty();
        if !empty || step.logprobs.is_some() || step.finish.is_some() || self.return_token_ids {
            Ok(vec![
                chunk(&self.chunk_for(index, delta, Some(step))).into(),
            ])
        } else {
            Ok(Vec::new())
        }
    }

    fn on_end(&mut self) -> Vec<SseChunk> {
        self.log();
        if !self.include_usage {
            return Vec::new();
        }
        let mut c = self.envelope("chat.completion.chunk", Vec::new());
        c.usage = Some(Some(self.usage()));
        vec![chunk(&c).into()]
    }
}

/// The text of one token (special tokens included), for log-probability listings.
pub fn token_text(tokenizer: &Tokenizer, id: u32) -> String {
    tokenizer.decode(&[id]).unwrap_or_default()
}

fn token_bytes(tokenizer: &Tokenizer, id: u32) -> Vec<u8> {
    tokenizer.token_bytes(id).unwrap_or_default()
}

pub fn token_logprob(tokenizer: &Tokenizer, id: u32, l: &TokenLogprobs) -> ChatTokenLogprob {
    let token = token_text(tokenizer, id);
    ChatTokenLogprob {
        bytes: token_bytes(tokenizer, id),
        token,
        logprob: l.logprob,
        top_logprobs: l
            .top
            .iter()
            .map(|t| {
                let token = token_text(tokenizer, t.token_id);
                ChatTopLogprob {
                    bytes: token_bytes(tokenizer, t.token_id),
                    token,
                    logprob: t.logprob,
                }
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(v: Value) -> Result<Value, ApiError> {
        template_messages(serde_json::from_value(v).unwrap())
    }

    #[test]
    fn tool_call_arguments_become_objects_for_the_template() {
        let out = messages(json!([
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]))
        .unwrap();
        assert_eq!(out[0]["role"], "system");
        assert_eq!(out[1]["content"][0]["text"], "weather?");
        assert_eq!(
            out[2]["tool_calls"][0]["function"]["arguments"],
            json!({"city": "Paris"})
        );
        assert_eq!(out[3]["tool_call_id"], "call_1");
    }

    #[test]
    fn cache_points_are_the_second_and_the_last_message_starts() {
        const S: u32 = 7;
        // system, user, assistant (generation prompt)
        assert_eq!(
            message_starts(&[S, 1, 2, S, 3, 4, S, 5], Some(S)),
            vec![3, 6]
        );
        // user, generation prompt: one point
        assert_eq!(message_starts(&[S, 1, 2, S, 5], Some(S)), vec![3]);
        // many messages: the second start and the last
        assert_eq!(
            message_starts(&[S, 1, S, 2, S, 3, S, 4, S], Some(S)),
            vec![2, 8]
        );
        assert!(message_starts(&[S, 1, 2], Some(S)).is_empty());
        assert!(message_starts(&[1, 2, 3], None).is_empty());
    }

    #[test]
    fn unsupported_messages_are_refused() {
        assert!(messages(json!([])).is_err());
        assert!(messages(json!([{"role": "wizard", "content": "x"}])).is_err());
        let image = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]);
        assert!(messages(image).is_err());
        let bad_args = json!([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]);
        assert!(messages(bad_args).is_err());
    }
}

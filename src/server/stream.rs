//! Server-sent event streams: the engine's events of every choice, turned into `data: {...}`
//! chunks (named with `event:` where the API names them) by an endpoint's [`ChunkWriter`], then
//! `data: [DONE]` where the API ends its streams so.
//!
//! The stream owns the engine's event receivers: when the client disconnects, the server drops
//! the stream, the receivers go with it, and the engine cancels the sequences at its next step.

use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, BoxStream, StreamExt};
use serde::Serialize;

use super::errors::ApiError;
use crate::engine::scheduler::Event;

/// One server-sent event: its `data:` line and, for APIs that name events, its `event:` line.
pub struct SseChunk {
    pub event: Option<&'static str>,
    pub data: String,
}

impl SseChunk {
    pub fn event(name: &'static str, data: String) -> Self {
        Self {
            event: Some(name),
            data,
        }
    }
}

impl From<String> for SseChunk {
    fn from(data: String) -> Self {
        Self { event: None, data }
    }
}

/// Writes an endpoint's chunks for the events of a stream.
pub trait ChunkWriter: Send + 'static {
    /// Chunks sent at once, before the engine's first event (which waits for the prefill).
    fn on_start(&mut self) -> Vec<SseChunk> {
        Vec::new()
    }
    /// Chunks for one event of choice `index`; an error ends the stream with
    /// [`ChunkWriter::on_error`]'s chunks.
    fn on_event(&mut self, index: usize, event: Event) -> Result<Vec<SseChunk>, ApiError>;
    /// Chunks after every choice finished (the usage chunk, say).
    fn on_end(&mut self) -> Vec<SseChunk>;
    /// Chunks that end a stream on an error: the error's body, by default.
    fn on_error(&mut self, error: ApiError) -> Vec<SseChunk> {
        vec![chunk(&error.body()).into()]
    }
    /// Whether the stream ends with `data: [DONE]` (Chat Completions and Completions do).
    fn ends_with_done(&self) -> bool {
        true
    }
}

/// An endpoint's reply, sent either as a stream of chunks or whole.
pub trait Reply: ChunkWriter {
    /// The non-streaming response body.
    type Whole: Serialize;
    /// Records one event of choice `index` into the whole reply.
    fn record(&mut self, index: usize, event: Event) -> Result<(), ApiError>;
    /// The whole reply once every choice finished.
    fn whole(self) -> Self::Whole;
}

/// Answers with `reply` built from `events`: an SSE stream when `stream`, else one JSON body
/// once every choice finished.
pub async fn respond<R: Reply>(
    events: BoxStream<'static, (usize, Event)>,
    mut reply: R,
    stream: bool,
) -> Result<Response, ApiError> {
    if stream {
        return Ok(sse_response(events, reply));
    }
    let mut events = events;
    while let Some((index, event)) = events.next().await {
        reply.record(index, event)?;
    }
    Ok(axum::Json(reply.whole()).into_response())
}

/// Serialises a chunk for a `data:` line.
pub fn chunk(value: &impl Serialize) -> String {
    serde_json::to_string(value).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
}

/// The SSE response for `events`, with chunks from `writer`.
pub fn sse_response<W: ChunkWriter>(
    events: BoxStream<'static, (usize, Event)>,
    mut writer: W,
) -> Response {
    let opening = writer.on_start();
    let chunks = stream::unfold(Some((events, writer)), |state| async move {
        let (mut events, mut writer) = state?;
        let done = || SseChunk::from("[DONE]".to_owned());
        let (data, next) = match events.next().await {
            Some((index, event)) => match writer.on_event(index, event) {
                Ok(data) => (data, Some((events, writer))),
                Err(e) => {
                    let mut data = writer.on_error(e);
                    if writer.ends_with_done() {
                        data.push(done());
                    }
                    (data, None)
                }
            },
            None => {
                let mut data = writer.on_end();
                if writer.ends_with_done() {
                    data.push(done());
                }
                (data, None)
            }
        };
        Some((data, next))
    });
    let chunks = stream::once(async move { opening })
        .chain(chunks)
        .flat_map(|data| {
            stream::iter(data.into_iter().map(|c| {
                let event = SseEvent::default().data(c.data);
                Ok::<_, Infallible>(match c.event {
                    Some(name) => event.event(name),
                    None => event,
                })
            }))
        });
    Sse::new(chunks)
        .keep_alive(KeepAlive::default())
        .into_response()
}

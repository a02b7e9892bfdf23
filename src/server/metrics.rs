//! `/metrics`: the server's counters in the Prometheus text format (requests by route and
//! status, tokens in and out, prefix-cache hits, queue depth, prefill and decode speed, time to
//! first token).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use axum::extract::{MatchedPath, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::AppState;

/// HTTP requests answered, by route and status.
#[derive(Default)]
pub struct HttpMetrics {
    responses: Mutex<BTreeMap<(String, u16), u64>>,
}

/// Middleware counting every response by route (the matched pattern, so the label set stays
/// small) and status.
pub async fn count_requests(
    State(app): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", MatchedPath::as_str)
        .to_owned();
    let response = next.run(request).await;
    let status = response.status().as_u16();
    if let Ok(mut responses) = app.http_metrics.responses.lock() {
        *responses.entry((route, status)).or_insert(0) += 1;
    }
    response
}

pub async fn render(State(app): State<Arc<AppState>>) -> impl IntoResponse {
    let mut out = String::new();
    let m = app.engine.metrics();
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);

    metric(
        &mut out,
        "lily_http_requests_total",
        "counter",
        "HTTP requests answered, by route and status.",
    );
    if let Ok(responses) = app.http_metrics.responses.lock() {
        for ((route, status), count) in responses.iter() {
            let _ = writeln!(
                out,
                "lily_http_requests_total{{route=\"{route}\",status=\"{status}\"}} {count}"
            );
        }
    }
    for (name, help, value) in [
        (
            "lily_requests_finished_total",
            "Generations that finished (stop or length).",
            load(&m.requests_finished),
        ),
        (
            "lily_requests_failed_total",
            "Generations that failed.",
            load(&m.requests_failed),
        ),
        (
            "lily_requests_cancelled_total",
            "Generations cancelled because the client went away.",
            load(&m.requests_cancelled),
        ),
        (
            "lily_prompt_tokens_total",
            "Prompt tokens prefilled (those taken from the prefix cache are not).",
            load(&m.prompt_tokens),
        ),
        (
            "lily_prompt_tokens_cached_total",
            "Prompt tokens taken from the prefix cache instead of prefilled.",
            load(&m.cached_prompt_tokens),
        ),
        (
            "lily_prefix_cache_hits_total",
            "Requests that started from a cached prefix of their prompt.",
            load(&m.prefix_cache_hits),
        ),
        (
            "lily_generation_tokens_total",
            "Tokens generated.",
            load(&m.generated_tokens),
        ),
        (
            "lily_decode_steps_total",
            "Batched decode steps run.",
            load(&m.decode_steps),
        ),
    ] {
        metric(&mut out, name, "counter", help);
        let _ = writeln!(out, "{name} {value}");
    }
    let prefill_seconds = load(&m.prefill_micros) as f64 / 1e6;
    let decode_seconds = load(&m.decode_micros) as f64 / 1e6;
    let per_second = |tokens: u64, seconds: f64| {
        if seconds > 0.0 {
            tokens as f64 / seconds
        } else {
            0.0
        }
    };
    let decoded_tokens = load(&m.decode_tokens);
    for (name, kind, help, value) in [
        (
            "lily_queue_depth",
            "gauge",
            "Requests waiting for a sequence slot.",
            m.waiting.load(Ordering::Relaxed) as f64,
        ),
        (
            "lily_running_sequences",
            "gauge",
            "Sequences being generated.",
            m.running.load(Ordering::Relaxed) as f64,
        ),
        (
            "lily_prefix_cache_entries",
            "gauge",
            "Sequence states the prefix cache holds.",
            m.prefix_cache_entries.load(Ordering::Relaxed) as f64,
        ),
        (
            "lily_prefill_seconds_total",
            "counter",
            "Time spent in prefill.",
            prefill_seconds,
        ),
        (
            "lily_decode_seconds_total",
            "counter",
            "Time spent in decode steps.",
            decode_seconds,
        ),
        (
            "lily_prefill_tokens_per_second",
            "gauge",
            "Prompt tokens per second of prefill time, since start.",
            per_second(load(&m.prompt_tokens), prefill_seconds),
        ),
        (
            "lily_decode_tokens_per_second",
            "gauge",
            "Tokens per second of decode time (all sequences of a step), since start.",
            per_second(decoded_tokens, decode_seconds),
        ),
    ] {
        metric(&mut out, name, kind, help);
        let _ = writeln!(out, "{name} {value}");
    }

    let name = "lily_time_to_first_token_seconds";
    metric(
        &mut out,
        name,
        "histogram",
        "Time from a request's arrival to its first token.",
    );
    let histogram = &m.time_to_first_token;
    let (cumulative, sum, count) = histogram.snapshot();
    for (bound, c) in histogram.bounds.iter().zip(cumulative) {
        let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {c}");
    }
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
    let _ = writeln!(out, "{name}_sum {sum}");
    let _ = writeln!(out, "{name}_count {count}");

    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        out,
    )
}

fn metric(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

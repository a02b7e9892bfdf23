//! The OpenAI-compatible server, in process: every endpoint and error, against the embedded demo
//! model, the tiny transformers fixtures (token-id prompts, greedy ids checked against
//! transformers) and the scripted fixture (a model whose greedy reply is a known tool call with
//! reasoning, made by `scripts/make_scripted_fixture.py`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use http_body_util::BodyExt;
use lily::backend::cpu::CpuBackend;
use lily::engine::scheduler::{Engine, EngineOptions};
use lily::server::{AppState, ServedModel, router};
use serde_json::{Value, json};
use tower::ServiceExt;

/// Bans the demo's end-of-sequence ids (`<|endoftext|>`, `<|im_end|>`) where a run must be long.
fn no_eos() -> Value {
    json!({"256": -100, "258": -100})
}
/// A hang guard for waits (not a timing assertion).
const PATIENCE: Duration = Duration::from_secs(120);

struct Server {
    router: Router,
    app: Arc<AppState>,
    engine: Option<Engine>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(engine) = self.engine.take() {
            engine.handle().cancel_all();
        }
    }
}

#[derive(Clone, Copy)]
struct Limits {
    max_batch: usize,
    max_queue: usize,
    prefill_chunk: usize,
    context: usize,
    max_body_bytes: usize,
    prefix_cache: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_batch: 8,
            max_queue: 64,
            prefill_chunk: 16,
            context: 4096,
            max_body_bytes: 1 << 20,
            prefix_cache: 8,
        }
    }
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn start(source: Option<&Path>, limits: Limits, api_key: Option<&str>) -> Server {
    let (model, served) = match source {
        Some(dir) => ServedModel::load(dir).unwrap(),
        None => ServedModel::demo().unwrap(),
    };
    let engine = Engine::start(
        move || Ok(CpuBackend::new(model)),
        served.tokenizer.clone(),
        EngineOptions {
            max_batch: limits.max_batch,
            max_queue: limits.max_queue,
            prefill_chunk: limits.prefill_chunk,
            prefix_cache: limits.prefix_cache,
        },
    )
    .unwrap();
    let app = Arc::new(AppState::new(
        engine.handle(),
        served,
        limits.context,
        api_key.map(str::to_owned),
    ));
    Server {
        router: router(app.clone(), limits.max_body_bytes),
        app,
        engine: Some(engine),
    }
}

fn demo() -> Server {
    start(None, Limits::default(), None)
}

fn post_request(path: &str, body: impl Into<Body>) -> Request<Body> {
    Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body.into())
        .unwrap()
}

async fn send(router: &Router, request: Request<Body>) -> (StatusCode, Vec<u8>) {
    let response = tokio::time::timeout(PATIENCE, router.clone().oneshot(request))
        .await
        .expect("no response")
        .unwrap();
    let status = response.status();
    let body = tokio::time::timeout(PATIENCE, response.into_body().collect())
        .await
        .expect("body never ended")
        .unwrap()
        .to_bytes()
        .to_vec();
    (status, body)
}

async fn post(server: &Server, path: &str, body: Value) -> (StatusCode, Value) {
    let (status, bytes) = send(&server.router, post_request(path, body.to_string())).await;
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| panic!("not JSON: {}", String::from_utf8_lossy(&bytes)));
    (status, value)
}

async fn get(server: &Server, path: &str) -> (StatusCode, String) {
    let (status, bytes) = send(
        &server.router,
        Request::get(path).body(Body::empty()).unwrap(),
    )
    .await;
    (status, String::from_utf8(bytes).unwrap())
}

/// The `data:` payloads of an SSE body; the last must be `[DONE]`, which is dropped.
fn sse_events(body: &[u8]) -> Vec<Value> {
    let text = String::from_utf8(body.to_vec()).unwrap();
    let data: Vec<&str> = text
        .split("\n\n")
        .filter_map(|event| event.lines().find_map(|l| l.strip_prefix("data: ")))
        .collect();
    assert_eq!(
        data.last(),
        Some(&"[DONE]"),
        "stream must end with [DONE]: {text}"
    );
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

async fn stream(server: &Server, path: &str, mut body: Value) -> (StatusCode, Vec<Value>) {
    body["stream"] = json!(true);
    let (status, bytes) = send(&server.router, post_request(path, body.to_string())).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&bytes)
    );
    (status, sse_events(&bytes))
}

/// Reasoning, content and finish reason of a streamed chat reply (choice 0).
fn streamed_chat(events: &[Value]) -> (String, String, Vec<Value>, String) {
    let (mut reasoning, mut content, mut calls, mut finish) =
        (String::new(), String::new(), Vec::new(), String::new());
    for e in events {
        for c in e["choices"].as_array().unwrap() {
            let d = &c["delta"];
            reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
            content.push_str(d["content"].as_str().unwrap_or(""));
            calls.extend(d["tool_calls"].as_array().cloned().unwrap_or_default());
            if let Some(f) = c["finish_reason"].as_str() {
                finish = f.to_owned();
            }
        }
    }
    (reasoning, content, calls, finish)
}

fn streamed_text(events: &[Value]) -> String {
    events
        .iter()
        .flat_map(|e| e["choices"].as_array().unwrap().clone())
        .map(|c| c["text"].as_str().unwrap().to_owned())
        .collect()
}

fn error_of(value: &Value) -> (&str, Option<&str>, Option<&str>) {
    let e = &value["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{value}"
    );
    (
        e["type"].as_str().unwrap(),
        e["param"].as_str(),
        e["code"].as_str(),
    )
}

fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({
        "model": "lily-demo",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 24,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

async fn wait_until(server: &Server, what: &str, condition: impl Fn(&AppState) -> bool) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !condition(&server.app) {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn models_health_and_unknown_routes() {
    let server = demo();
    let (status, body) = get(&server, "/v1/models").await;
    assert_eq!(status, StatusCode::OK);
    let models: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "lily-demo");
    assert!(
        models["data"][0]["owned_by"]
            .as_str()
            .unwrap()
            .contains("demo")
    );
    let (status, body) = get(&server, "/v1/models/lily-demo").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body) = get(&server, "/v1/models/gpt-4").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        error_of(&serde_json::from_str(&body).unwrap()).2,
        Some("model_not_found")
    );
    let (status, body) = get(&server, "/health").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["status"],
        "ok"
    );
    let (status, body) = get(&server, "/v2/nothing").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    error_of(&serde_json::from_str(&body).unwrap());
}

#[tokio::test]
async fn chat_completion_whole_and_streamed_agree() {
    let server = demo();
    let (status, whole) = post(&server, "/v1/chat/completions", chat("Hello", json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{whole}");
    assert!(whole["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["model"], "lily-demo");
    assert!(whole["created"].as_u64().unwrap() > 1_600_000_000);
    let choice = &whole["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    let usage = &whole["usage"];
    assert_eq!(usage["completion_tokens"], 24);
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + 24
    );
    // The demo's template opens a thought, and random weights never close it: all reasoning.
    let reasoning = choice["message"]["reasoning_content"].as_str().unwrap();
    assert!(!reasoning.is_empty());
    assert_eq!(choice["message"]["content"], "");

    let (_, events) = stream(
        &server,
        "/v1/chat/completions",
        chat("Hello", json!({"stream_options": {"include_usage": true}})),
    )
    .await;
    assert_eq!(events[0]["object"], "chat.completion.chunk");
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let (r, c, calls, finish) = streamed_chat(&events);
    assert_eq!((r.as_str(), c.as_str()), (reasoning, ""));
    assert!(calls.is_empty());
    assert_eq!(finish, "length");
    let last = events.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"], *usage);
    assert!(
        events[..events.len() - 1]
            .iter()
            .all(|e| e["usage"].is_null())
    );
    assert!(events.iter().all(|e| e["id"] == events[0]["id"]));
}

#[tokio::test]
async fn thinking_disabled_replies_in_content() {
    let server = demo();
    let body = chat(
        "Hello",
        json!({"chat_template_kwargs": {"enable_thinking": false}}),
    );
    let (status, whole) = post(&server, "/v1/chat/completions", body.clone()).await;
    assert_eq!(status, StatusCode::OK);
    let message = &whole["choices"][0]["message"];
    assert!(message.get("reasoning_content").is_none(), "{whole}");
    let content = message["content"].as_str().unwrap();
    assert!(!content.is_empty());
    let (_, events) = stream(&server, "/v1/chat/completions", body).await;
    let (r, c, _, _) = streamed_chat(&events);
    assert_eq!((r.as_str(), c.as_str()), ("", content));
}

/// `reasoning_effort: "none"` turns thinking off as `enable_thinking: false` does; other efforts
/// leave it on; an unknown one is refused.
#[tokio::test]
async fn reasoning_effort_none_turns_thinking_off() {
    let server = demo();
    let kwargs = json!({"chat_template_kwargs": {"enable_thinking": false}});
    let (_, off) = post(&server, "/v1/chat/completions", chat("Hello", kwargs)).await;
    let (_, none) = post(
        &server,
        "/v1/chat/completions",
        chat("Hello", json!({"reasoning_effort": "none"})),
    )
    .await;
    assert_eq!(none["choices"][0]["message"], off["choices"][0]["message"]);
    let (_, high) = post(
        &server,
        "/v1/chat/completions",
        chat("Hello", json!({"reasoning_effort": "high"})),
    )
    .await;
    assert!(high["choices"][0]["message"]["reasoning_content"].is_string());
    let (status, v) = post(
        &server,
        "/v1/chat/completions",
        chat("Hello", json!({"reasoning_effort": "extreme"})),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_of(&v).1, Some("reasoning_effort"));
}

#[tokio::test]
async fn completions_from_text_and_from_ids() {
    let server = demo();
    let body = json!({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0});
    let (status, whole) = post(&server, "/v1/completions", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{whole}");
    assert!(whole["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(whole["object"], "text_completion");
    assert_eq!(whole["usage"]["prompt_tokens"], 16);
    let text = whole["choices"][0]["text"].as_str().unwrap().to_owned();
    let (_, events) = stream(&server, "/v1/completions", body.clone()).await;
    assert_eq!(streamed_text(&events), text);

    // The same prompt as byte-level ids (the demo tokenizer has one token per byte).
    let ids: Vec<u32> = "Once upon a time".bytes().map(u32::from).collect();
    let by_ids =
        json!({"prompt": ids, "max_tokens": 16, "temperature": 0, "return_token_ids": true});
    let (_, whole_ids) = post(&server, "/v1/completions", by_ids).await;
    assert_eq!(whole_ids["choices"][0]["text"], text.as_str());
    assert_eq!(whole_ids["prompt_token_ids"], json!(ids));
    assert_eq!(
        whole_ids["choices"][0]["token_ids"]
            .as_array()
            .unwrap()
            .len(),
        16
    );

    let echo =
        json!({"prompt": ["Once upon a time"], "max_tokens": 16, "temperature": 0, "echo": true});
    let (_, echoed) = post(&server, "/v1/completions", echo.clone()).await;
    assert_eq!(
        echoed["choices"][0]["text"],
        format!("Once upon a time{text}")
    );
    let (_, events) = stream(&server, "/v1/completions", echo).await;
    assert_eq!(streamed_text(&events), format!("Once upon a time{text}"));
}

/// `echo` with `logprobs` scores the prompt (OpenAI's legacy way, which lm-evaluation-harness
/// uses for likelihoods): every prompt token is listed, the first with `null`s, each later one
/// with its logprob given the tokens before it, which for a prompt that ends in the greedy
/// continuation of its first part is that token's logprob as it was generated; `max_tokens: 0`
/// only scores; whole and streamed agree.
#[tokio::test]
async fn echo_with_logprobs_scores_the_prompt() {
    let server = demo();
    let body = json!({"prompt": "Once upon", "max_tokens": 1, "temperature": 0, "logprobs": 2});
    let (_, first) = post(&server, "/v1/completions", body).await;
    let next = first["choices"][0]["text"].as_str().unwrap().to_owned();
    let generated = first["choices"][0]["logprobs"]["token_logprobs"][0]
        .as_f64()
        .unwrap();

    let text = format!("Once upon{next}");
    for max_tokens in [0, 3] {
        let body = json!({"prompt": [text.clone()], "max_tokens": max_tokens, "temperature": 0,
                          "logprobs": 2, "echo": true});
        let (status, v) = post(&server, "/v1/completions", body.clone()).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        let c = &v["choices"][0];
        let l = &c["logprobs"];
        let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
        let listed = prompt_tokens + max_tokens;
        assert_eq!(v["usage"]["completion_tokens"], max_tokens);
        for field in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            assert_eq!(l[field].as_array().unwrap().len(), listed, "{field}: {v}");
        }
        assert!(l["token_logprobs"][0].is_null() && l["top_logprobs"][0].is_null());
        let tokens: String = (0..prompt_tokens)
            .map(|i| l["tokens"][i].as_str().unwrap())
            .collect();
        assert_eq!(tokens, text);
        assert_eq!(l["text_offset"][1], l["tokens"][0].as_str().unwrap().len());
        for i in 1..listed {
            let lp = l["token_logprobs"][i].as_f64().unwrap();
            let top = l["top_logprobs"][i].as_object().unwrap();
            // The two most likely, and the token itself where it is neither.
            assert!(lp <= 0.0 && (2..=3).contains(&top.len()), "{i}: {v}");
            let token = l["tokens"][i].as_str().unwrap();
            assert_eq!(top[token].as_f64(), Some(lp), "{i}: {v}");
            let best = top
                .values()
                .map(|t| t.as_f64().unwrap())
                .fold(f64::MIN, f64::max);
            assert!(best >= lp - 1e-6, "{i}: {v}");
        }
        let scored = l["token_logprobs"][prompt_tokens - 1].as_f64().unwrap();
        assert!((scored - generated).abs() < 1e-4, "{scored} vs {generated}");
        assert!(c["text"].as_str().unwrap().starts_with(&text));
        assert_eq!(c["finish_reason"], "length");

        let (_, events) = stream(&server, "/v1/completions", body).await;
        assert_eq!(streamed_text(&events), c["text"].as_str().unwrap());
        let streamed: Vec<Value> = events
            .iter()
            .filter_map(|e| e["choices"][0]["logprobs"]["token_logprobs"].as_array())
            .flatten()
            .cloned()
            .collect();
        assert_eq!(&streamed, l["token_logprobs"].as_array().unwrap());
    }
    let body = json!({"prompt": "x", "max_tokens": 0});
    let (status, v) = post(&server, "/v1/completions", body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(error_of(&v).1, Some("max_tokens"));
}

/// A batch of prompts (texts or id lists) gets each prompt's completions, numbered prompt by
/// prompt, each what the prompt gets alone (greedy), whole and streamed, with the echo of its
/// own prompt; usage counts every prompt once.
#[tokio::test]
async fn a_batch_of_prompts_gets_each_prompts_own_completions() {
    let server = demo();
    let texts = ["Once upon a time", "The", "In 1912 the ship"];
    let mut alone = Vec::new();
    let mut prompt_tokens = 0;
    for text in texts {
        let body = json!({"prompt": text, "max_tokens": 8, "temperature": 0});
        let (_, v) = post(&server, "/v1/completions", body).await;
        alone.push(v["choices"][0]["text"].as_str().unwrap().to_owned());
        prompt_tokens += v["usage"]["prompt_tokens"].as_u64().unwrap();
    }
    let batch = json!({"prompt": texts, "max_tokens": 8, "temperature": 0, "n": 2, "echo": true});
    let (status, v) = post(&server, "/v1/completions", batch.clone()).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let p = i / 2;
        assert_eq!(c["text"], format!("{}{}", texts[p], alone[p]), "choice {i}");
    }
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(v["usage"]["completion_tokens"], 6 * 8);

    let (_, events) = stream(&server, "/v1/completions", batch).await;
    let mut streamed = vec![String::new(); 6];
    for e in &events {
        for c in e["choices"].as_array().unwrap() {
            streamed[c["index"].as_u64().unwrap() as usize].push_str(c["text"].as_str().unwrap());
        }
    }
    for (i, text) in streamed.iter().enumerate() {
        assert_eq!(
            text,
            &format!("{}{}", texts[i / 2], alone[i / 2]),
            "choice {i}"
        );
    }

    // The same as token-id lists.
    let (_, ids) = post(&server, "/tokenize", json!({"prompt": texts[1]})).await;
    let lists = json!({"prompt": [ids["tokens"], ids["tokens"]], "max_tokens": 8,
                       "temperature": 0});
    let (_, v) = post(&server, "/v1/completions", lists).await;
    let texts_back: Vec<&str> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts_back, [alone[1].as_str(), alone[1].as_str()]);
}

/// vLLM's `ignore_eos` (an end-of-sequence id made certain by a bias no longer ends the reply),
/// `stop_token_ids` (another id ends it, unwritten) and `min_tokens` (those ids are banned, and
/// stop strings unmatched, until that many tokens are out), on both endpoints.
#[tokio::test]
async fn ignore_eos_stop_token_ids_and_min_tokens_move_where_the_reply_ends() {
    let server = demo();
    for (path, base) in [
        ("/v1/completions", json!({"prompt": "The"})),
        ("/v1/chat/completions", chat("The", json!({}))),
    ] {
        for (extra, tokens, finish, text) in [
            (json!({"logit_bias": {"258": 100}}), 1, "stop", Some("")),
            (
                json!({"logit_bias": {"258": 100}, "ignore_eos": true}),
                5,
                "length",
                None,
            ),
            (
                json!({"logit_bias": {"65": 100}}),
                5,
                "length",
                Some("AAAAA"),
            ),
            (
                json!({"logit_bias": {"65": 100}, "stop_token_ids": [65]}),
                1,
                "stop",
                Some(""),
            ),
            (
                json!({"logit_bias": {"258": 100}, "min_tokens": 3}),
                4,
                "stop",
                None,
            ),
            (
                json!({"logit_bias": {"258": 100}, "min_tokens": 5}),
                5,
                "length",
                None,
            ),
            (
                json!({"logit_bias": {"65": 100}, "stop_token_ids": [65], "min_tokens": 2}),
                3,
                "stop",
                None,
            ),
            (
                json!({"logit_bias": {"65": 100}, "stop": ["A"]}),
                1,
                "stop",
                Some(""),
            ),
            // Stop strings only match from the min_tokens-th token on; the text before stays.
            (
                json!({"logit_bias": {"65": 100}, "stop": ["A"], "min_tokens": 3}),
                3,
                "stop",
                Some("AA"),
            ),
        ] {
            let mut body = base.clone();
            body["max_tokens"] = json!(5);
            body["temperature"] = json!(0);
            body["chat_template_kwargs"] = json!({"enable_thinking": false});
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            if path == "/v1/completions" {
                body.as_object_mut().unwrap().remove("chat_template_kwargs");
            }
            let (status, v) = post(&server, path, body).await;
            assert_eq!(status, StatusCode::OK, "{v}");
            let c = &v["choices"][0];
            assert_eq!(
                v["usage"]["completion_tokens"], tokens,
                "{path} {extra}: {v}"
            );
            assert_eq!(c["finish_reason"], finish, "{path} {extra}: {v}");
            if let Some(text) = text {
                let got = c.get("text").unwrap_or(&c["message"]["content"]);
                assert_eq!(got, text, "{path} {extra}: {v}");
            }
        }
    }
    for ids in [json!([-1]), json!([265]), json!(["7"])] {
        let body = json!({"prompt": "x", "stop_token_ids": ids});
        let (status, v) = post(&server, "/v1/completions", body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
        assert!(
            error_of(&v)
                .1
                .is_some_and(|p| p.starts_with("stop_token_ids")),
            "{v}"
        );
    }
    for min in [json!(-1), json!(6), json!("2")] {
        let body = json!({"prompt": "x", "max_tokens": 5, "min_tokens": min});
        let (status, v) = post(&server, "/v1/completions", body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
        assert!(
            error_of(&v).1.is_some_and(|p| p.starts_with("min_tokens")),
            "{v}"
        );
    }
}

#[tokio::test]
async fn stop_strings_end_the_text_and_are_never_emitted() {
    let server = demo();
    let body = json!({"prompt": "The", "max_tokens": 40, "temperature": 0});
    let (_, whole) = post(&server, "/v1/completions", body.clone()).await;
    let text = whole["choices"][0]["text"].as_str().unwrap().to_owned();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 20, "{text:?}");
    let stop: String = chars[10..13].iter().collect();
    let cut = text.find(&stop).unwrap();
    for stop_field in [json!(stop), json!(["\u{1}never", stop])] {
        let mut with_stop = body.clone();
        with_stop["stop"] = stop_field;
        let (_, stopped) = post(&server, "/v1/completions", with_stop.clone()).await;
        assert_eq!(stopped["choices"][0]["text"], &text[..cut]);
        assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
        let (_, events) = stream(&server, "/v1/completions", with_stop).await;
        assert_eq!(streamed_text(&events), &text[..cut]);
    }
}

#[tokio::test]
async fn sampling_with_a_seed_reproduces_and_n_gives_several_choices() {
    let server = demo();
    let body = json!({"prompt": "Hi", "max_tokens": 12, "temperature": 1.0, "top_p": 0.9,
                      "top_k": 50, "min_p": 0.01, "presence_penalty": 0.5,
                      "frequency_penalty": 0.5, "repetition_penalty": 1.1, "seed": 7, "n": 3});
    let (status, first) = post(&server, "/v1/completions", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{first}");
    let (_, second) = post(&server, "/v1/completions", body.clone()).await;
    let texts = |v: &Value| -> Vec<String> {
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["text"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(texts(&first).len(), 3);
    assert_eq!(texts(&first), texts(&second));
    assert_ne!(
        texts(&first)[0],
        texts(&first)[1],
        "choices draw with different seeds"
    );
    assert_eq!(first["usage"]["completion_tokens"], 36);
    let (_, events) = stream(&server, "/v1/completions", body).await;
    let mut streamed = vec![String::new(); 3];
    for e in &events {
        for c in e["choices"].as_array().unwrap() {
            streamed[c["index"].as_u64().unwrap() as usize].push_str(c["text"].as_str().unwrap());
        }
    }
    assert_eq!(streamed, texts(&first));
}

#[tokio::test]
async fn logprobs_list_the_chosen_and_top_tokens() {
    let server = demo();
    let body = chat(
        "Hi",
        json!({"logprobs": true, "top_logprobs": 3, "max_tokens": 5}),
    );
    let (status, whole) = post(&server, "/v1/chat/completions", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{whole}");
    let content = whole["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    assert_eq!(content.len(), 5);
    for token in content {
        let top = token["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["token"], token["token"]);
        assert_eq!(top[0]["logprob"], token["logprob"]);
        assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64());
        assert!(token["logprob"].as_f64().unwrap() <= 0.0);
    }
    let (_, events) = stream(&server, "/v1/chat/completions", body).await;
    let streamed: Vec<&Value> = events
        .iter()
        .filter_map(|e| e["choices"][0]["logprobs"]["content"].as_array())
        .flatten()
        .collect();
    assert_eq!(streamed.len(), 5);
    assert_eq!(streamed[0]["token"], content[0]["token"]);

    let legacy = json!({"prompt": "Hi", "max_tokens": 4, "temperature": 0, "logprobs": 2});
    let (_, whole) = post(&server, "/v1/completions", legacy).await;
    let l = &whole["choices"][0]["logprobs"];
    assert_eq!(l["tokens"].as_array().unwrap().len(), 4);
    assert_eq!(l["top_logprobs"][0].as_object().unwrap().len(), 2);
    assert_eq!(l["text_offset"][0], 0);
}

/// A long system prompt (the demo's tokenizer has one token per byte), so that its prefixes are
/// long enough for the prefix cache.
fn long_system() -> String {
    "You are a careful assistant. Answer briefly and never guess. ".repeat(3)
}

fn conversation(messages: Value) -> Value {
    json!({"model": "lily-demo", "messages": messages, "temperature": 0, "max_tokens": 12,
           "logit_bias": no_eos(), "return_token_ids": true})
}

fn cached_tokens(reply: &Value) -> u64 {
    reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {reply}"))
}

fn metric_value(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
        .parse()
        .unwrap()
}

/// The next turn of a conversation, and another conversation with the same system prompt, start
/// from cached states, and their replies are the ones an engine without the cache gives. (A
/// cached prefix moves the DeltaNet's prefill chunks, so logits differ by rounding, ~1e-5 here;
/// these greedy replies have no near ties, and a wrong state changes them all.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefix_cache_serves_later_turns_and_changes_no_reply() {
    let cached = demo();
    let uncached = start(
        None,
        Limits {
            prefix_cache: 0,
            ..Limits::default()
        },
        None,
    );
    let system = json!({"role": "system", "content": long_system()});
    let first = conversation(json!([system, {"role": "user", "content": "What is 2 + 2?"}]));
    let second_user = json!({"role": "user", "content": "And 3 + 3?"});
    let other = conversation(json!([system, {"role": "user", "content": "Name a colour."}]));

    let mut replies = Vec::new();
    for server in [&cached, &uncached] {
        let (status, one) = post(server, "/v1/chat/completions", first.clone()).await;
        assert_eq!(status, StatusCode::OK, "{one}");
        let message = &one["choices"][0]["message"];
        let reply = json!({"role": "assistant", "content": message["content"],
                           "reasoning_content": message["reasoning_content"]});
        let next = conversation(json!([system, first["messages"][1], reply, second_user]));
        let (_, two) = post(server, "/v1/chat/completions", next).await;
        let (_, three) = post(server, "/v1/chat/completions", other.clone()).await;
        replies.push([one, two, three]);
    }
    // Where the prompt's messages start (each with `<|im_start|>`, the prompt's first token).
    let message_starts = |reply: &Value| -> Vec<u64> {
        let ids = reply["prompt_token_ids"].as_array().unwrap();
        (0..ids.len() as u64)
            .filter(|&i| ids[i as usize] == ids[0])
            .collect()
    };
    let [one, two, three] = &replies[0];
    let [one_u, two_u, three_u] = &replies[1];
    for (a, b) in [(one, one_u), (two, two_u), (three, three_u)] {
        assert_eq!(a["choices"][0]["message"], b["choices"][0]["message"]);
        assert_eq!(a["usage"]["prompt_tokens"], b["usage"]["prompt_tokens"]);
        assert_eq!(cached_tokens(b), 0);
    }
    assert_eq!(cached_tokens(one), 0);
    // The second turn repeats the first prompt up to its generation prompt, at least.
    let generation_prompt = *message_starts(one).last().unwrap();
    assert!(
        cached_tokens(two) >= generation_prompt
            && cached_tokens(two) < two["usage"]["prompt_tokens"].as_u64().unwrap(),
        "{two}"
    );
    // The other conversation shares the system block: everything before its user message.
    assert_eq!(cached_tokens(three), message_starts(three)[1], "{three}");

    let (_, text) = get(&cached, "/metrics").await;
    assert_eq!(metric_value(&text, "lily_prefix_cache_hits_total"), 2.0);
    assert_eq!(
        metric_value(&text, "lily_prompt_tokens_cached_total"),
        (cached_tokens(two) + cached_tokens(three)) as f64
    );
    assert!(metric_value(&text, "lily_prefix_cache_entries") >= 3.0);

    // The same request again starts from its own cached prefix, whose prefill was split where
    // its first run's was: the same logprobs, to the bit.
    let mut with_logprobs = first.clone();
    with_logprobs["logprobs"] = json!(true);
    with_logprobs["top_logprobs"] = json!(3);
    let (_, before) = post(&uncached, "/v1/chat/completions", with_logprobs.clone()).await;
    let (_, again) = post(&cached, "/v1/chat/completions", with_logprobs.clone()).await;
    let (_, once_more) = post(&cached, "/v1/chat/completions", with_logprobs).await;
    assert!(
        cached_tokens(&again) > 0 && cached_tokens(&once_more) > 0,
        "{again}"
    );
    assert_eq!(
        again["choices"][0]["logprobs"],
        once_more["choices"][0]["logprobs"]
    );
    assert_eq!(
        again["choices"][0]["message"],
        before["choices"][0]["message"]
    );

    // Choices admitted together: the later ones start from what the first stored on its way.
    let mut choices = conversation(json!([system, {"role": "user", "content": "Count to 3."}]));
    choices["n"] = json!(3);
    let (_, v) = post(&cached, "/v1/chat/completions", choices).await;
    let messages: Vec<&Value> = (0..3).map(|i| &v["choices"][i]["message"]).collect();
    assert!(messages.iter().all(|m| *m == messages[0]), "{v}");
    assert_eq!(
        cached_tokens(&v),
        *message_starts(&v).last().unwrap(),
        "{v}"
    );
}

/// A finished sequence leaves its state, so a prompt that continues its output (a completion
/// fed back) starts after it; the same prompt again finds no state that leaves a token to
/// prefill; replies are unchanged.
#[tokio::test]
async fn a_finished_sequence_is_continued_from_the_cache() {
    let dir = fixture("tiny-text");
    let cached = start(Some(&dir), Limits::default(), None);
    let uncached = start(
        Some(&dir),
        Limits {
            prefix_cache: 0,
            ..Limits::default()
        },
        None,
    );
    let prompt: Vec<u32> = (0..80u32).map(|i| (i * 37 + 11) % 200).collect();
    let body = |prompt: &[u32]| json!({"prompt": prompt, "max_tokens": 10, "temperature": 0, "return_token_ids": true});
    let mut runs = Vec::new();
    for server in [&cached, &uncached] {
        let (status, first) = post(server, "/v1/completions", body(&prompt)).await;
        assert_eq!(status, StatusCode::OK, "{first}");
        let ids: Vec<u32> =
            serde_json::from_value(first["choices"][0]["token_ids"].clone()).unwrap();
        let mut continued = prompt.clone();
        continued.extend(&ids);
        continued.extend([5, 6, 7]);
        let (_, next) = post(server, "/v1/completions", body(&continued)).await;
        let (_, again) = post(server, "/v1/completions", body(&prompt)).await;
        runs.push([first, next, again]);
    }
    for (a, b) in runs[0].iter().zip(&runs[1]) {
        assert_eq!(a["choices"][0]["token_ids"], b["choices"][0]["token_ids"]);
        assert_eq!(cached_tokens(b), 0);
    }
    let [first, next, again] = &runs[0];
    assert_eq!(cached_tokens(first), 0);
    // Every token the first request fed to the model: its prompt and all its ids but the last.
    let generated = first["choices"][0]["token_ids"].as_array().unwrap().len() as u64;
    assert!(generated > 1, "{first}");
    assert_eq!(cached_tokens(next), 80 + generated - 1, "{next}");
    assert_eq!(cached_tokens(again), 0, "{again}");
}

fn colour_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "colour": {"enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["ok", "colour", "count"],
        "additionalProperties": false,
    })
}

/// Whether `content` is a JSON object that `colour_schema` accepts.
fn follows_colour_schema(content: &str) -> bool {
    let Ok(Value::Object(v)) = serde_json::from_str::<Value>(content) else {
        return false;
    };
    v.len() == 3
        && v["ok"].is_boolean()
        && ["red", "green", "blue"].contains(&v["colour"].as_str().unwrap_or(""))
        && v["count"].as_u64().is_some_and(|c| c <= 99)
}

/// `response_format` holds the random demo model to a JSON schema, in whole and streamed replies,
/// with sampling and several choices; `json_object` to an object; with the thought open, from
/// where the model closes it.
#[tokio::test]
async fn structured_output_follows_the_json_schema() {
    let server = demo();
    let format = json!({"type": "json_schema",
                        "json_schema": {"name": "colour", "strict": true, "schema": colour_schema()}});
    let body = chat(
        "Pick a colour.",
        json!({"response_format": format, "max_tokens": 64,
               "chat_template_kwargs": {"enable_thinking": false}}),
    );
    let (status, whole) = post(&server, "/v1/chat/completions", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{whole}");
    let content = whole["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(follows_colour_schema(content), "{content:?}");
    assert_eq!(whole["choices"][0]["finish_reason"], "stop");
    let (_, events) = stream(&server, "/v1/chat/completions", body.clone()).await;
    assert_eq!(streamed_chat(&events).1, content);

    let mut sampled = body.clone();
    sampled["temperature"] = json!(1.0);
    sampled["seed"] = json!(3);
    sampled["n"] = json!(4);
    let (_, v) = post(&server, "/v1/chat/completions", sampled).await;
    for choice in v["choices"].as_array().unwrap() {
        let content = choice["message"]["content"].as_str().unwrap();
        assert!(follows_colour_schema(content), "{content:?}");
    }

    // A raw completion too (its text may start with the newlines the grammar allows).
    let completion = json!({"prompt": "Pick a colour: ", "response_format": format,
                            "max_tokens": 64, "temperature": 0});
    let (status, v) = post(&server, "/v1/completions", completion).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(follows_colour_schema(text.trim_start()), "{text:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");

    // `json_object`: the closing brace favoured, so the object ends at once.
    let object = chat(
        "Reply in JSON.",
        json!({"response_format": {"type": "json_object"}, "logit_bias": {"125": 50},
               "chat_template_kwargs": {"enable_thinking": false}}),
    );
    let (_, v) = post(&server, "/v1/chat/completions", object).await;
    assert_eq!(v["choices"][0]["message"]["content"], "{}", "{v}");

    // Thinking on: the grammar starts at `</think>` (id 260, favoured so the thought closes).
    let thinking = chat(
        "Pick a colour.",
        json!({"response_format": format, "max_tokens": 64, "logit_bias": {"260": 100}}),
    );
    let (_, v) = post(&server, "/v1/chat/completions", thinking).await;
    let message = &v["choices"][0]["message"];
    assert!(
        follows_colour_schema(message["content"].as_str().unwrap()),
        "{v}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
}

fn mode_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "set_mode", "parameters": {
            "type": "object",
            "properties": {
                "mode": {"enum": ["fast", "slow"]},
                "level": {"type": "integer", "minimum": 1, "maximum": 5},
                "loud": {"type": "boolean"},
            },
            "required": ["mode", "level"],
        }}},
        {"type": "function", "function": {"name": "stop_all"}},
    ])
}

/// `parallel_tool_calls: false` with the model free to call (`auto`): the reply ends once it has
/// written `</tool_call>` (id 262 of the demo, made likely here by a bias), the text kept; with
/// parallel calls allowed, or without tools, the same reply runs on.
#[tokio::test]
async fn one_call_at_most_ends_the_reply_at_the_first_closing_tag() {
    let server = demo();
    for (extra, ends) in [
        (
            json!({"tools": mode_tools(), "parallel_tool_calls": false}),
            true,
        ),
        (
            json!({"tools": mode_tools(), "parallel_tool_calls": true}),
            false,
        ),
        (json!({"tools": mode_tools()}), false),
        (
            json!({"tools": mode_tools(), "parallel_tool_calls": false,
                "tool_choice": "none"}),
            false,
        ),
        (json!({"parallel_tool_calls": false}), false),
    ] {
        let mut body = chat(
            "Go.",
            json!({"max_tokens": 6, "temperature": 0, "logit_bias": {"262": 100},
                   "chat_template_kwargs": {"enable_thinking": false}}),
        );
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, v) = post(&server, "/v1/chat/completions", body).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        let (tokens, finish) = (
            &v["usage"]["completion_tokens"],
            &v["choices"][0]["finish_reason"],
        );
        if ends {
            assert_eq!(
                (tokens, finish),
                (&json!(1), &json!("stop")),
                "{extra}: {v}"
            );
            assert_eq!(v["choices"][0]["message"]["content"], "</tool_call>", "{v}");
        } else {
            assert_eq!(
                (tokens, finish),
                (&json!(6), &json!("length")),
                "{extra}: {v}"
            );
        }
    }
}

/// `tool_choice` `required` and a named function make the random demo model call tools, with
/// arguments of the schema's types, whether the thought is open or not.
#[tokio::test]
async fn forced_tool_choice_makes_the_model_call() {
    let server = demo();
    let named = json!({"type": "function", "function": {"name": "set_mode"}});
    for (choice, extra) in [
        (
            named.clone(),
            json!({"chat_template_kwargs": {"enable_thinking": false}}),
        ),
        // A forced call has no content for `response_format` to shape.
        (
            json!("required"),
            json!({"chat_template_kwargs": {"enable_thinking": false},
                   "response_format": {"type": "json_object"}}),
        ),
        (named.clone(), json!({"logit_bias": {"260": 100}})),
        (
            json!("required"),
            json!({"chat_template_kwargs": {"enable_thinking": false},
                   "parallel_tool_calls": false}),
        ),
    ] {
        for seed in 0..3 {
            let mut body = chat(
                "Go.",
                json!({"tools": mode_tools(), "tool_choice": choice, "max_tokens": 400,
                       "temperature": 1.0, "seed": seed}),
            );
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            let (status, v) = post(&server, "/v1/chat/completions", body).await;
            assert_eq!(status, StatusCode::OK, "{v}");
            let choice0 = &v["choices"][0];
            assert_eq!(choice0["finish_reason"], "tool_calls", "{v}");
            let calls = choice0["message"]["tool_calls"].as_array().unwrap();
            assert!(!calls.is_empty(), "{v}");
            if extra["parallel_tool_calls"] == false {
                assert_eq!(calls.len(), 1, "{v}");
            }
            for call in calls {
                let name = call["function"]["name"].as_str().unwrap();
                let args: Value =
                    serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
                if choice == named {
                    assert_eq!(name, "set_mode", "{v}");
                }
                if name == "set_mode" {
                    assert!(
                        ["fast", "slow"].contains(&args["mode"].as_str().unwrap()),
                        "{v}"
                    );
                    assert!((1..=5).contains(&args["level"].as_i64().unwrap()), "{v}");
                    assert!(args.get("loud").is_none_or(Value::is_boolean), "{v}");
                } else {
                    assert_eq!((name, args), ("stop_all", json!({})), "{v}");
                }
            }
        }
    }
    for (extra, why) in [
        (json!({"tool_choice": "required"}), "no tools"),
        (
            json!({"tools": mode_tools(), "tool_choice": {"type": "function",
                   "function": {"name": "missing"}}}),
            "an unknown tool",
        ),
        (
            json!({"tools": mode_tools(), "tool_choice": "sometimes"}),
            "a bad mode",
        ),
        (
            json!({"tools": mode_tools(), "tool_choice": {"function": {}}}),
            "no name",
        ),
    ] {
        let (status, v) = post(&server, "/v1/chat/completions", chat("x", extra)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{why}: {v}");
        assert_eq!(error_of(&v).1, Some("tool_choice"), "{why}: {v}");
    }
}

#[tokio::test]
async fn unusable_response_formats_are_refused() {
    let server = demo();
    for format in [
        json!({"type": "json_schema"}),
        json!({"type": "xml"}),
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": [1, 2]}}),
    ] {
        let (status, v) = post(
            &server,
            "/v1/chat/completions",
            chat("hi", json!({"response_format": format})),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{format}: {v}");
        assert_eq!(error_of(&v).1, Some("response_format"), "{v}");
    }
}

/// The greedy ids of the tiny fixtures through the server match transformers' (`golden.json`),
/// with both prompts running at once and the long one prefilled in chunks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixtures_match_transformers_through_the_server() {
    for name in ["tiny-text", "tiny-wrapper"] {
        let dir = fixture(name);
        let golden: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap())
                .unwrap();
        let server = start(Some(&dir), Limits::default(), None);
        let requests = golden["prompts"].as_array().unwrap().iter().map(|prompt| {
            let expected = golden["greedy"][golden["prompts"]
                .as_array()
                .unwrap()
                .iter()
                .position(|p| p == prompt)
                .unwrap()]
            .clone();
            let body = json!({
                "model": name, "prompt": prompt, "max_tokens": expected.as_array().unwrap().len(),
                "return_token_ids": true,
            });
            let router = server.router.clone();
            async move {
                let (status, bytes) =
                    send(&router, post_request("/v1/completions", body.to_string())).await;
                assert_eq!(
                    status,
                    StatusCode::OK,
                    "{}",
                    String::from_utf8_lossy(&bytes)
                );
                let v: Value = serde_json::from_slice(&bytes).unwrap();
                assert_eq!(v["choices"][0]["token_ids"], expected, "{name}");
                assert_eq!(v["choices"][0]["finish_reason"], "length");
                assert_eq!(v["choices"][0]["text"], "", "no tokenizer, no text");
            }
        });
        futures_util::future::join_all(requests).await;
        // Without a tokenizer, chat and text prompts are refused clearly.
        let (status, v) = post(&server, "/v1/completions", json!({"prompt": "hi"})).await;
        assert_eq!(
            (status, error_of(&v).1),
            (StatusCode::BAD_REQUEST, Some("prompt"))
        );
        let (status, _) = post(
            &server,
            "/v1/chat/completions",
            chat("hi", json!({"model": name})),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
    }
}

/// Many streams at once give each the text it gets alone (greedy), through queueing (more
/// clients than `max_batch`) and batched decode steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_streams_match_their_solo_runs() {
    let limits = Limits {
        max_batch: 5,
        prefill_chunk: 8,
        ..Limits::default()
    };
    let server = start(None, limits, None);
    let prompts: Vec<String> = (0..12)
        .map(|i| format!("Prompt {i}: {}", "x".repeat(i * 3)))
        .collect();
    let body = |p: &str| json!({"prompt": p, "max_tokens": 20 + p.len() % 7, "temperature": 0});
    let mut solo = Vec::new();
    for p in &prompts {
        let (_, v) = post(&server, "/v1/completions", body(p)).await;
        solo.push(v["choices"][0]["text"].as_str().unwrap().to_owned());
    }
    let runs = prompts.iter().map(|p| {
        let router = server.router.clone();
        let mut b = body(p);
        b["stream"] = json!(true);
        async move {
            let (status, bytes) =
                send(&router, post_request("/v1/completions", b.to_string())).await;
            assert_eq!(status, StatusCode::OK);
            streamed_text(&sse_events(&bytes))
        }
    });
    let handles: Vec<_> = runs.map(tokio::spawn).collect();
    for (handle, expected) in handles.into_iter().zip(solo) {
        assert_eq!(handle.await.unwrap(), expected);
    }
    // Sequences are retired (their state freed) just after their last event.
    wait_until(&server, "every sequence is retired", |app| {
        app.engine.metrics().running.load(Ordering::Relaxed) == 0
    })
    .await;
}

/// A client that goes away mid-stream has its sequence dropped; another stream is unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnected_stream_is_cancelled_and_others_continue() {
    let server = demo();
    let other = json!({"prompt": "steady", "max_tokens": 60, "temperature": 0});
    let (_, alone) = post(&server, "/v1/completions", other.clone()).await;
    let alone = alone["choices"][0]["text"].as_str().unwrap().to_owned();

    let long = json!({"prompt": "forever", "max_tokens": 4000, "temperature": 0, "stream": true,
                      "logit_bias": no_eos()});
    let response = server
        .router
        .clone()
        .oneshot(post_request("/v1/completions", long.to_string()))
        .await
        .unwrap();
    let mut body = response.into_body();
    let mut received = String::new();
    while received.matches("data: ").count() < 3 {
        let frame = tokio::time::timeout(PATIENCE, body.frame())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if let Some(data) = frame.data_ref() {
            received.push_str(&String::from_utf8_lossy(data));
        }
    }
    let mut other_stream = other.clone();
    other_stream["stream"] = json!(true);
    let router = server.router.clone();
    let other_run = tokio::spawn(async move {
        let (_, bytes) = send(
            &router,
            post_request("/v1/completions", other_stream.to_string()),
        )
        .await;
        streamed_text(&sse_events(&bytes))
    });
    drop(body);
    wait_until(&server, "the dropped stream is cancelled", |app| {
        app.engine
            .metrics()
            .requests_cancelled
            .load(Ordering::Relaxed)
            == 1
    })
    .await;
    assert_eq!(other_run.await.unwrap(), alone);
    wait_until(&server, "nothing runs", |app| {
        app.engine.metrics().running.load(Ordering::Relaxed) == 0
    })
    .await;
    assert!(
        server
            .app
            .engine
            .metrics()
            .generated_tokens
            .load(Ordering::Relaxed)
            < 4000
    );
}

/// Sends a streaming request and reads its first frame: the body, to read on, and that frame.
async fn open_stream(server: &Server, path: &str, body: &Value) -> (Body, String) {
    let response = server
        .router
        .clone()
        .oneshot(post_request(path, body.to_string()))
        .await
        .unwrap();
    let mut body = response.into_body();
    let frame = tokio::time::timeout(PATIENCE, body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let first = String::from_utf8_lossy(frame.data_ref().unwrap()).into_owned();
    (body, first)
}

/// Streams open at once, while their requests still wait for a sequence slot (the only one is
/// taken by a long stream): a Responses stream with `response.created`, a chat stream with the
/// role chunk.
#[tokio::test]
async fn queued_streams_open_at_once() {
    let server = start(
        None,
        Limits {
            max_batch: 1,
            ..Limits::default()
        },
        None,
    );
    let long = json!({"prompt": "forever", "max_tokens": 4000, "temperature": 0, "stream": true,
                      "logit_bias": no_eos()});
    let hog = server
        .router
        .clone()
        .oneshot(post_request("/v1/completions", long.to_string()))
        .await
        .unwrap();
    wait_until(&server, "the long stream runs", |app| {
        app.engine.metrics().running.load(Ordering::Relaxed) == 1
    })
    .await;
    // Greedy: a sampled reply may end early with an end-of-sequence id, and the check below
    // needs it to run into its token limit.
    let queued = json!({"input": "hi", "stream": true, "max_output_tokens": 4, "temperature": 0});
    let (body, first) = open_stream(&server, "/v1/responses", &queued).await;
    assert!(
        first.contains("event: response.created\n")
            && first.contains("\"type\":\"response.created\""),
        "{first:?}"
    );
    let chat_stream = chat("hi", json!({"stream": true, "max_tokens": 4}));
    let (chat_body, first) = open_stream(&server, "/v1/chat/completions", &chat_stream).await;
    assert!(first.contains("\"role\":\"assistant\""), "{first:?}");
    // Both still queued: the slot is the long stream's.
    assert_eq!(
        server.app.engine.metrics().waiting.load(Ordering::Relaxed),
        2
    );
    drop(hog);
    drop(chat_body);
    let rest = tokio::time::timeout(PATIENCE, body.collect())
        .await
        .unwrap()
        .unwrap()
        .to_bytes();
    let rest = String::from_utf8_lossy(&rest).into_owned();
    assert!(rest.contains("event: response.incomplete"), "{rest}");
}

/// A non-streaming client that goes away (its request future dropped, as hyper does on a
/// disconnect) cancels its sequence too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_whole_request_is_cancelled() {
    let server = demo();
    let long = json!({"prompt": "forever", "max_tokens": 4000, "temperature": 0,
                      "logit_bias": no_eos()});
    let router = server.router.clone();
    let request = tokio::spawn(async move {
        send(&router, post_request("/v1/completions", long.to_string())).await
    });
    wait_until(&server, "the request runs", |app| {
        app.engine.metrics().running.load(Ordering::Relaxed) == 1
    })
    .await;
    request.abort();
    wait_until(&server, "the abandoned request is cancelled", |app| {
        let m = app.engine.metrics();
        m.requests_cancelled.load(Ordering::Relaxed) == 1 && m.running.load(Ordering::Relaxed) == 0
    })
    .await;
    assert!(
        server
            .app
            .engine
            .metrics()
            .generated_tokens
            .load(Ordering::Relaxed)
            < 4000
    );
}

#[tokio::test]
async fn malformed_requests_get_openai_errors() {
    let server = demo();
    let (status, bytes) = send(
        &server.router,
        post_request("/v1/chat/completions", "{not json"),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(
        error_of(&v),
        ("invalid_request_error", None, Some("invalid_json"))
    );
    let (status, bytes) = send(&server.router, post_request("/v1/completions", "[1, 2]")).await;
    assert_eq!(
        status,
        StatusCode::BAD_REQUEST,
        "{}",
        String::from_utf8_lossy(&bytes)
    );

    let cases = [
        (
            "/v1/chat/completions",
            chat("x", json!({"temperature": "hot"})),
            "temperature",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"messages": "hello"})),
            "messages",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"max_tokens": 0})),
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"max_completion_tokens": -3})),
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"max_tokens": 100_000})),
            "max_tokens",
        ),
        ("/v1/chat/completions", chat("x", json!({"n": 0})), "n"),
        ("/v1/chat/completions", chat("x", json!({"n": 99})), "n"),
        (
            "/v1/chat/completions",
            chat("x", json!({"temperature": -1})),
            "temperature",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"top_p": 0})),
            "top_p",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"top_k": -5})),
            "top_k",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"presence_penalty": 3})),
            "presence_penalty",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"logit_bias": {"abc": 1}})),
            "logit_bias",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"logit_bias": {"5": 500}})),
            "logit_bias",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"top_logprobs": 2})),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"logprobs": true, "top_logprobs": 50})),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"tool_choice": "required"})),
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"response_format": {"type": "yaml"}})),
            "response_format",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"messages": []})),
            "messages",
        ),
        (
            "/v1/chat/completions",
            chat(
                "x",
                json!({"messages": [{"role": "robot", "content": "x"}]}),
            ),
            "messages",
        ),
        (
            "/v1/chat/completions",
            chat(
                "x",
                json!({"messages": [{"role": "assistant", "content": "only me"}]}),
            ),
            "messages",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"stop": 5})),
            "stop",
        ),
        ("/v1/completions", json!({"prompt": ["a", ""]}), "prompt"),
        ("/v1/completions", json!({"prompt": []}), "prompt"),
        (
            "/v1/completions",
            json!({"prompt": ["a", "b"], "return_token_ids": true}),
            "return_token_ids",
        ),
        ("/v1/completions", json!({"prompt": [1, 99999]}), "prompt"),
        ("/v1/completions", json!({"prompt": ""}), "prompt"),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": 99}),
            "logprobs",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "suffix": "y"}),
            "suffix",
        ),
        ("/v1/completions", json!({}), "prompt"),
    ];
    for (path, body, param) in cases {
        let (status, v) = post(&server, path, body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body} -> {v}");
        let (kind, got_param, _) = error_of(&v);
        assert_eq!(kind, "invalid_request_error");
        assert_eq!(got_param, Some(param), "{body} -> {v}");
    }
    // Explicit nulls mean "not given", as many clients send them.
    let nulls = json!({"stream": null, "stream_options": null, "logprobs": null, "top_logprobs": null,
                       "max_completion_tokens": null, "temperature": null, "stop": null, "n": null, "seed": null,
                       "tools": null, "tool_choice": null, "return_token_ids": null});
    let (status, v) = post(&server, "/v1/chat/completions", chat("x", nulls)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (status, v) = post(
        &server,
        "/v1/completions",
        json!({"prompt": "x", "echo": null, "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (status, v) = post(
        &server,
        "/v1/completions",
        json!({"model": "gpt-4", "prompt": "x"}),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(error_of(&v).2, Some("model_not_found"));
    // The server still serves.
    let (status, _) = post(
        &server,
        "/v1/chat/completions",
        chat("still there?", json!({})),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn prompts_longer_than_the_context_and_oversized_bodies_are_refused() {
    let limits = Limits {
        context: 64,
        max_body_bytes: 4096,
        ..Limits::default()
    };
    let server = start(None, limits, None);
    let (status, v) = post(
        &server,
        "/v1/completions",
        json!({"prompt": "y".repeat(64)}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_of(&v).2, Some("context_length_exceeded"));
    let (status, v) = post(
        &server,
        "/v1/completions",
        json!({"prompt": "y".repeat(40), "max_tokens": 30}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        error_of(&v),
        (
            "invalid_request_error",
            Some("max_tokens"),
            Some("context_length_exceeded")
        )
    );
    // Without max_tokens the completion fills the rest of the context.
    let (status, v) = post(
        &server,
        "/v1/completions",
        json!({"prompt": "y".repeat(40), "temperature": 0, "logit_bias": no_eos()}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["usage"]["total_tokens"], 64);
    let (status, bytes) = send(
        &server.router,
        post_request(
            "/v1/completions",
            json!({"prompt": "z".repeat(5000)}).to_string(),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(error_of(&v).2, Some("request_too_large"));
}

/// `/tokenize` renders a conversation as chat does (the same ids as the completion's prompt,
/// tools and thinking switch included) and tokenizes text; `/detokenize` gives the text back.
#[tokio::test]
async fn tokenize_counts_what_chat_would_prefill_and_detokenize_inverts_it() {
    let server = demo();
    let extra = json!({"tools": mode_tools(), "chat_template_kwargs": {"enable_thinking": false},
                       "max_tokens": 1, "return_token_ids": true});
    let (status, completion) = post(&server, "/v1/chat/completions", chat("Hi there", extra)).await;
    assert_eq!(status, StatusCode::OK, "{completion}");
    let body = json!({"messages": [{"role": "user", "content": "Hi there"}], "model": "lily-demo",
                      "tools": mode_tools(), "chat_template_kwargs": {"enable_thinking": false}});
    let (status, v) = post(&server, "/tokenize", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["tokens"], completion["prompt_token_ids"]);
    assert_eq!(v["count"], completion["usage"]["prompt_tokens"]);
    assert_eq!(v["max_model_len"], 4096);
    // Without the generation prompt the assistant turn is not opened: fewer tokens.
    let mut closed = body.clone();
    closed["add_generation_prompt"] = json!(false);
    let (_, fewer) = post(&server, "/tokenize", closed).await;
    assert!(fewer["count"].as_u64() < v["count"].as_u64(), "{fewer}");

    let text = "Grüße, <think>tags</think> and 数字 42";
    let (status, v) = post(&server, "/tokenize", json!({"prompt": text})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(
        v["count"].as_u64().unwrap() as usize,
        v["tokens"].as_array().unwrap().len()
    );
    let (status, back) = post(&server, "/detokenize", json!({"tokens": v["tokens"]})).await;
    assert_eq!((status, back), (StatusCode::OK, json!({"prompt": text})));

    for (path, body, param) in [
        (
            "/tokenize",
            json!({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}),
            None,
        ),
        ("/tokenize", json!({}), None),
        ("/tokenize", json!({"messages": []}), Some("messages")),
        (
            "/tokenize",
            json!({"messages": [{"role": "user", "content": "b"}],
                             "reasoning_effort": "lots"}),
            Some("reasoning_effort"),
        ),
        ("/detokenize", json!({"tokens": [1, 265]}), Some("tokens")),
        ("/detokenize", json!({"tokens": [-1]}), Some("tokens")),
        ("/detokenize", json!({"tokens": "12"}), Some("tokens")),
    ] {
        let (status, v) = post(&server, path, body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {v}");
        assert_eq!(error_of(&v).1, param, "{body}: {v}");
    }
    let (status, _) = post(
        &server,
        "/tokenize",
        json!({"prompt": "a", "model": "gpt-4"}),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn the_api_key_guards_all_but_health_and_metrics() {
    let server = start(None, Limits::default(), Some("sekrit"));
    let body = json!({"prompt": "hi", "max_tokens": 2});
    let request = |key: Option<&str>| {
        let mut r = post_request("/v1/completions", body.to_string());
        if let Some(key) = key {
            r.headers_mut().insert(
                header::AUTHORIZATION,
                format!("Bearer {key}").parse().unwrap(),
            );
        }
        r
    };
    for (key, expected) in [
        (None, StatusCode::UNAUTHORIZED),
        (Some("wrong"), StatusCode::UNAUTHORIZED),
        (Some("sekrit"), StatusCode::OK),
    ] {
        let (status, bytes) = send(&server.router, request(key)).await;
        assert_eq!(status, expected);
        if status == StatusCode::UNAUTHORIZED {
            let v: Value = serde_json::from_slice(&bytes).unwrap();
            assert_eq!(error_of(&v).2, Some("invalid_api_key"));
        }
    }
    let (status, _) = get(&server, "/v1/models").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = post(&server, "/tokenize", json!({"prompt": "hi"})).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(get(&server, "/health").await.0, StatusCode::OK);
    assert_eq!(get(&server, "/metrics").await.0, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_429_and_shutdown_503() {
    let limits = Limits {
        max_batch: 1,
        max_queue: 1,
        ..Limits::default()
    };
    let server = start(None, limits, None);
    let long = json!({"prompt": "a", "max_tokens": 4000, "temperature": 0, "stream": true,
                      "logit_bias": no_eos()});
    let router = server.router.clone();
    let first = tokio::spawn(async move {
        send(&router, post_request("/v1/completions", long.to_string())).await
    });
    wait_until(&server, "the first request runs", |app| {
        app.engine.metrics().running.load(Ordering::Relaxed) == 1
    })
    .await;
    let router = server.router.clone();
    let queued = tokio::spawn(async move {
        send(
            &router,
            post_request(
                "/v1/completions",
                json!({"prompt": "b", "max_tokens": 3}).to_string(),
            ),
        )
        .await
    });
    wait_until(&server, "the second request waits", |app| {
        app.engine.metrics().waiting.load(Ordering::Relaxed) == 1
    })
    .await;
    let (status, v) = post(
        &server,
        "/v1/completions",
        json!({"prompt": "c", "max_tokens": 3}),
    )
    .await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(error_of(&v), ("rate_limit_error", None, Some("queue_full")));

    let (_, metrics) = get(&server, "/metrics").await;
    assert!(metrics.contains("lily_queue_depth 1"), "{metrics}");
    assert!(metrics.contains("lily_running_sequences 1"), "{metrics}");
    assert!(
        metrics.contains("lily_http_requests_total{route=\"/v1/completions\",status=\"429\"} 1")
    );

    // Shutdown: new requests get 503, the running and queued ones end with an error event.
    let engine = server.app.engine.clone();
    engine.cancel_all();
    let (status, v) = post(&server, "/v1/completions", json!({"prompt": "d"})).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(error_of(&v).2, Some("shutting_down"));
    let (status, bytes) = first.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    let events = sse_events(&bytes);
    assert!(
        events.last().unwrap()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("shutting down")
    );
    let (status, _) = queued.await.unwrap();
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
}

#[tokio::test]
async fn metrics_count_tokens_and_time_to_first_token() {
    let server = demo();
    let (status, v) = post(
        &server,
        "/v1/completions",
        json!({"prompt": "abc", "max_tokens": 5}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    // Unseeded sampling may draw the end-of-text token before max_tokens.
    let generated = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=5).contains(&generated), "{v}");
    let (status, text) = get(&server, "/metrics").await;
    assert_eq!(status, StatusCode::OK);
    for line in [
        "lily_prompt_tokens_total 3",
        &format!("lily_generation_tokens_total {generated}"),
        "lily_requests_finished_total 1",
        "lily_time_to_first_token_seconds_count 1",
        "lily_http_requests_total{route=\"/v1/completions\",status=\"200\"} 1",
        "lily_queue_depth 0",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
    for name in [
        "lily_prefill_tokens_per_second",
        "lily_decode_tokens_per_second",
    ] {
        let value: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap()
            .parse()
            .unwrap();
        assert!(value > 0.0, "{name}");
    }
}

fn weather_tools() -> Value {
    json!([{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }])
}

fn scripted_chat(extra: Value) -> Value {
    let mut body = json!({
        "model": "scripted",
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": weather_tools(),
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The scripted model thinks, then calls `get_weather` in Qwen's XML form: the server returns
/// the thought as `reasoning_content` and the call as an OpenAI tool call, whole and streamed.
#[tokio::test]
async fn reasoning_and_tool_calls_are_parsed_from_the_reply() {
    let server = start(Some(&fixture("scripted")), Limits::default(), None);
    let (status, whole) = post(&server, "/v1/chat/completions", scripted_chat(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{whole}");
    let choice = &whole["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let message = &choice["message"];
    assert_eq!(
        message["reasoning_content"],
        "I should check the weather in Paris."
    );
    assert!(message["content"].is_null(), "{whole}");
    let call = &message["tool_calls"][0];
    assert_eq!(message["tool_calls"].as_array().unwrap().len(), 1);
    assert_eq!(call["type"], "function");
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["function"]["name"], "get_weather");
    let arguments: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"city": "Paris", "days": 3}));

    let (_, events) = stream(&server, "/v1/chat/completions", scripted_chat(json!({}))).await;
    let (reasoning, content, calls, finish) = streamed_chat(&events);
    assert_eq!(reasoning, "I should check the weather in Paris.");
    assert_eq!(content, "");
    assert_eq!(finish, "tool_calls");
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["index"], 0);
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(
        calls[0]["function"]["arguments"],
        call["function"]["arguments"]
    );
    // The thought streams in more than one delta.
    let reasoning_deltas = events
        .iter()
        .filter(|e| e["choices"][0]["delta"]["reasoning_content"].is_string())
        .count();
    assert!(reasoning_deltas >= 2);

    // Thinking off: the template closes the thought and the reply is the call alone.
    let off = scripted_chat(json!({"chat_template_kwargs": {"enable_thinking": false}}));
    let (_, whole) = post(&server, "/v1/chat/completions", off).await;
    let message = &whole["choices"][0]["message"];
    assert!(message.get("reasoning_content").is_none(), "{whole}");
    assert_eq!(message["tool_calls"][0]["function"]["name"], "get_weather");
}

#[tokio::test]
async fn without_tools_a_tool_call_stays_text() {
    let server = start(Some(&fixture("scripted")), Limits::default(), None);
    for extra in [json!({"tools": null}), json!({"tool_choice": "none"})] {
        let (status, whole) = post(&server, "/v1/chat/completions", scripted_chat(extra)).await;
        assert_eq!(status, StatusCode::OK, "{whole}");
        let choice = &whole["choices"][0];
        assert_eq!(choice["finish_reason"], "stop");
        assert!(choice["message"].get("tool_calls").is_none());
        let content = choice["message"]["content"].as_str().unwrap();
        assert!(
            content.starts_with("<tool_call>\n<function=get_weather>"),
            "{content:?}"
        );
        assert!(content.ends_with("</tool_call>"));
    }
    // A stop string inside the thought ends the reply there.
    let (_, whole) = post(
        &server,
        "/v1/chat/completions",
        scripted_chat(json!({"stop": ["Paris"]})),
    )
    .await;
    assert_eq!(
        whole["choices"][0]["message"]["reasoning_content"],
        "I should check the weather in"
    );
    assert_eq!(whole["choices"][0]["finish_reason"], "stop");
    // The raw completion of another prompt is the greeting.
    let (_, v) = post(
        &server,
        "/v1/completions",
        json!({"prompt": "Hi", "model": "scripted"}),
    )
    .await;
    assert_eq!(v["choices"][0]["text"], "Lily says hello.");
    assert_eq!(v["usage"]["completion_tokens"], 4);
}

/// A conversation that already holds a tool call and its result renders (arguments given as a
/// JSON string, as OpenAI clients send them).
#[tokio::test]
async fn a_tool_result_conversation_renders() {
    let server = start(Some(&fixture("scripted")), Limits::default(), None);
    let body = scripted_chat(json!({"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": null, "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]}));
    let (status, whole) = post(&server, "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{whole}");
    assert_eq!(whole["choices"][0]["finish_reason"], "tool_calls");
}

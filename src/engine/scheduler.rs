//! The engine loop: one thread owns the backend and runs every sequence; request handlers talk to
//! it through channels.
//!
//! A handler [`submit`](EngineHandle::submit)s a [`GenerationRequest`] and receives [`Event`]s
//! (one per chosen token, then the finish) on its own channel. The loop keeps a FIFO queue of
//! waiting requests and admits them while fewer than `max_batch` sequences run. Each iteration
//! prefills at most `prefill_chunk` prompt tokens (long prompts go in several chunks, appended
//! to the same state) and then runs one batched decode step for every sequence past its prompt,
//! so a long prompt delays the running streams by one chunk per step, not by its whole length.
//! A sequence whose event receiver is gone (the client disconnected) is dropped, with its state,
//! before the next step.
//!
//! A [`PrefixCache`] keeps states for later requests: a new request starts from the longest
//! cached prefix of its prompt (a copy of that state, see [`Backend::fork`]), prefill stops at
//! each of the request's `cache_points` to store a copy, and a sequence that finishes leaves its
//! own state behind, keyed by every token it fed to the model.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use super::constraint::Constraint;
use super::generate::{FinishReason, GenerationParams, Output};
use super::prefix_cache::{MIN_CACHED_PREFIX, PrefixCache};
use super::sampler::{Sampler, TokenLogprob, logprob_and_top, top_logprobs};
use crate::backend::{Backend, DeviceDraw, LogitsFor};
use crate::text::tokenizer::Tokenizer;

/// Limits of the engine.
#[derive(Clone, Copy, Debug)]
pub struct EngineOptions {
    /// Sequences run at once (admitted and holding backend state).
    pub max_batch: usize,
    /// Requests that may wait for admission; more are refused.
    pub max_queue: usize,
    /// Prompt tokens prefilled per engine step.
    pub prefill_chunk: usize,
    /// Sequence states the prefix cache keeps (0 turns it off). A backend with a fixed pool of
    /// states needs `max_batch + prefix_cache + 1` of them (a sequence that starts from a cached
    /// prefix holds its fresh state until the copy is made); with fewer the cache keeps fewer.
    pub prefix_cache: usize,
}

/// Prompt tokens a scored prompt (`prompt_logprobs`, and `lily perplexity`) prefills at a time:
/// each brings its row of logits back to the host (1 MB a token at the 35B's vocabulary, so
/// 256 MB a chunk), and on the GPU each chunk reads the expert weights again.
pub const SCORED_CHUNK: usize = 256;

/// One generation to run.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    /// Prompt lengths at which to keep a copy of the state in the prefix cache, for later
    /// prompts that share those tokens (chat: where its second and last messages start).
    /// Lengths under [`MIN_CACHED_PREFIX`] or not inside the prompt are ignored.
    pub cache_points: Vec<usize>,
    pub params: GenerationParams,
    /// `Some(k)`: report each chosen token's log-probability and the `k` most likely tokens.
    pub logprobs: Option<usize>,
    /// `Some(k)`: report the same for every prompt token after the first, given the ones before
    /// it ([`Event::PromptLogprobs`]; scoring). The prompt is then prefilled whole, not taken
    /// from the prefix cache.
    pub prompt_logprobs: Option<usize>,
    /// Added to the logits of the given ids before sampling.
    pub logit_bias: Vec<(u32, f32)>,
    /// A grammar the reply must follow (structured output).
    pub constraint: Option<Constraint>,
}

/// The log-probabilities reported for one chosen token.
#[derive(Clone, Debug)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<TokenLogprob>,
}

/// What the engine reports about a request, in order: the prompt's logprobs where asked for,
/// tokens, then `Finished` or `Failed`.
#[derive(Debug)]
pub enum Event {
    /// Prompt tokens 1.. scored, each given the tokens before it (once the prompt is prefilled).
    PromptLogprobs(Vec<TokenLogprobs>),
    Token {
        id: u32,
        /// Text now final (may be empty while a character or a possible stop string is held).
        text: String,
        logprobs: Option<TokenLogprobs>,
    },
    Finished {
        reason: FinishReason,
        completion_tokens: usize,
        /// Prompt tokens taken from the prefix cache instead of prefilled.
        cached_tokens: usize,
    },
    Failed(String),
}

/// Why a request was not queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the server is busy: the request queue is full")]
    QueueFull,
    #[error("the server is shutting down")]
    ShuttingDown,
}

/// Counters and gauges the engine keeps (read by `/metrics`).
#[derive(Default)]
pub struct EngineMetrics {
    pub waiting: AtomicUsize,
    pub running: AtomicUsize,
    pub requests_finished: AtomicU64,
    pub requests_failed: AtomicU64,
    pub requests_cancelled: AtomicU64,
    /// Prompt tokens prefilled (not those taken from the prefix cache).
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens taken from the prefix cache.
    pub cached_prompt_tokens: AtomicU64,
    /// Requests that started from a cached prefix.
    pub prefix_cache_hits: AtomicU64,
    /// States the prefix cache holds.
    pub prefix_cache_entries: AtomicUsize,
    pub generated_tokens: AtomicU64,
    pub prefill_micros: AtomicU64,
    pub decode_steps: AtomicU64,
    /// Tokens produced by decode steps (every sequence of a step).
    pub decode_tokens: AtomicU64,
    pub decode_micros: AtomicU64,
    pub time_to_first_token: Histogram,
}

/// A Prometheus-style histogram of durations.
pub struct Histogram {
    /// Upper bounds in seconds, ascending.
    pub bounds: &'static [f64],
    /// Observations at most each bound (not cumulative).
    counts: Vec<AtomicU64>,
    total_micros: AtomicU64,
    count: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        const BOUNDS: &[f64] = &[
            0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        ];
        Self {
            bounds: BOUNDS,
            counts: BOUNDS.iter().map(|_| AtomicU64::new(0)).collect(),
            total_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let seconds = d.as_secs_f64();
        if let Some(i) = self.bounds.iter().position(|&b| seconds <= b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.total_micros
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Cumulative counts per bound, the sum in seconds and the number of observations.
    pub fn snapshot(&self) -> (Vec<u64>, f64, u64) {
        let mut running = 0;
        let cumulative = self
            .counts
            .iter()
            .map(|c| {
                running += c.load(Ordering::Relaxed);
                running
            })
            .collect();
        (
            cumulative,
            self.total_micros.load(Ordering::Relaxed) as f64 / 1e6,
            self.count.load(Ordering::Relaxed),
        )
    }
}

/// State shared by the engine thread and its handles.
struct Shared {
    options: EngineOptions,
    metrics: EngineMetrics,
    accepting: AtomicBool,
}

/// What handles send to the engine thread.
enum Message {
    Submit(Box<Submission>),
    CancelAll,
}

struct Submission {
    request: GenerationRequest,
    events: UnboundedSender<Event>,
    submitted: Instant,
}

/// The engine: its thread and a handle to it. Dropping every handle lets the thread finish the
/// work it has and exit; [`Engine::join`] waits for that.
pub struct Engine {
    handle: EngineHandle,
    thread: JoinHandle<()>,
}

/// What handlers hold to talk to the engine (cheap to clone).
#[derive(Clone)]
pub struct EngineHandle {
    messages: UnboundedSender<Message>,
    shared: Arc<Shared>,
    vocab_size: usize,
    max_batch: usize,
}

impl Engine {
    /// Starts the engine thread, which builds its backend with `make_backend` (so the backend
    /// never crosses threads) and detokenises with `tokenizer` (without one, events carry ids and
    /// empty text). Returns once the backend is ready, or with its construction error.
    pub fn start<B, F>(
        make_backend: F,
        tokenizer: Option<Arc<Tokenizer>>,
        options: EngineOptions,
    ) -> Result<Engine>
    where
        B: Backend,
        F: FnOnce() -> Result<B> + Send + 'static,
    {
        anyhow::ensure!(options.max_batch >= 1, "max batch must be at least 1");
        anyhow::ensure!(
            options.prefill_chunk >= 1,
            "prefill chunk must be at least 1"
        );
        let shared = Arc::new(Shared {
            options,
            metrics: EngineMetrics::default(),
            accepting: AtomicBool::new(true),
        });
        let (messages, receiver) = unbounded_channel();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("lily-engine".into())
            .spawn(move || {
                let backend = match make_backend() {
                    Ok(backend) => backend,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                // A backend that fitted its pool of states to the memory it found may hold
                // fewer than `max_batch`.
                let max_batch = options
                    .max_batch
                    .min(backend.max_states().unwrap_or(usize::MAX));
                let _ = ready_tx.send(Ok((backend.config().vocab_size, max_batch)));
                EngineLoop {
                    backend: &backend,
                    tokenizer: tokenizer.as_deref(),
                    shared: &thread_shared,
                    max_batch,
                    messages: receiver,
                    waiting: VecDeque::new(),
                    running: Vec::new(),
                    cache: PrefixCache::new(cache_capacity(
                        max_batch,
                        options.prefix_cache,
                        backend.max_states(),
                    )),
                }
                .run();
            })
            .context("cannot start the engine thread")?;
        let (vocab_size, max_batch) = ready_rx
            .recv()
            .context("the engine thread stopped while building its backend")??;
        Ok(Engine {
            handle: EngineHandle {
                messages,
                shared,
                vocab_size,
                max_batch,
            },
            thread,
        })
    }

    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }

    /// Waits for the engine thread to finish (after every handle is dropped and the running
    /// sequences have ended).
    pub fn join(self) {
        drop(self.handle);
        if self.thread.join().is_err() {
            tracing::error!("the engine thread panicked");
        }
    }
}

impl EngineHandle {
    /// Queues a request; its events arrive on the returned receiver. Dropping the receiver
    /// cancels the request.
    pub fn submit(
        &self,
        request: GenerationRequest,
    ) -> Result<UnboundedReceiver<Event>, SubmitError> {
        if !self.shared.accepting.load(Ordering::Acquire) {
            return Err(SubmitError::ShuttingDown);
        }
        let max_queue = self.shared.options.max_queue;
        self.shared
            .metrics
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w < max_queue).then_some(w + 1)
            })
            .map_err(|_| SubmitError::QueueFull)?;
        let (events, receiver) = unbounded_channel();
        let submission = Submission {
            request,
            events,
            submitted: Instant::now(),
        };
        if self
            .messages
            .send(Message::Submit(Box::new(submission)))
            .is_err()
        {
            self.shared.metrics.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(SubmitError::ShuttingDown);
        }
        Ok(receiver)
    }

    /// Refuses new requests from now on; queued and running ones continue.
    pub fn stop_accepting(&self) {
        self.shared.accepting.store(false, Ordering::Release);
    }

    /// Whether new requests are taken (false once shutdown began or the engine thread ended).
    pub fn is_accepting(&self) -> bool {
        self.shared.accepting.load(Ordering::Acquire) && !self.messages.is_closed()
    }

    /// Ends every queued and running request now (each gets [`Event::Failed`]).
    pub fn cancel_all(&self) {
        self.stop_accepting();
        let _ = self.messages.send(Message::CancelAll);
    }

    pub fn metrics(&self) -> &EngineMetrics {
        &self.shared.metrics
    }

    /// Rows of the model's logits (token ids must be below this).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Sequences generated at once: `EngineOptions::max_batch`, or fewer where the backend's
    /// pool of states is smaller.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }
}

/// One admitted request.
struct Sequence<'t, S> {
    state: S,
    prompt: Vec<u32>,
    /// Prompt tokens already prefilled (or taken from the prefix cache).
    prefilled: usize,
    /// Prompt lengths still ahead at which prefill stores a copy of the state, ascending.
    cache_points: Vec<usize>,
    /// Prompt tokens taken from the prefix cache.
    cached_tokens: usize,
    sampler: Sampler,
    output: Output<'t>,
    events: UnboundedSender<Event>,
    /// The chosen token not yet fed to the model (set once the prompt is done).
    next_token: Option<u32>,
    logprobs: Option<usize>,
    prompt_logprobs: Option<usize>,
    /// The prompt's scores so far (`prompt_logprobs`), sent when its prefill ends.
    prompt_scores: Vec<TokenLogprobs>,
    logit_bias: Vec<(u32, f32)>,
    constraint: Option<Constraint>,
    /// Plain argmax with nothing reported: the backend may pick the token itself.
    device_greedy: bool,
    /// A draw without bias or reported logprobs, and without penalties unless the backend
    /// applies them: a backend that samples on its own may draw the token itself.
    device_sampled: bool,
    /// The backend holds the sampler's penalty history for penalised draws: false until it is
    /// loaded, and again after each token the host chose.
    history_on_backend: bool,
    submitted: Instant,
    first_token_sent: bool,
    done: bool,
    /// Finished with a stop or the length limit: its state is consistent and may be cached.
    finished: bool,
}

impl<S> Sequence<'_, S> {
    /// Whether the end-of-sequence ids are still banned (`min_tokens` not yet reached), which
    /// takes the logits to the host.
    fn holds_back_eos(&self) -> bool {
        self.output.holds_back_eos()
    }
}

struct EngineLoop<'a, B: Backend> {
    backend: &'a B,
    tokenizer: Option<&'a Tokenizer>,
    shared: &'a Shared,
    /// `EngineHandle::max_batch`.
    max_batch: usize,
    messages: UnboundedReceiver<Message>,
    waiting: VecDeque<Submission>,
    running: Vec<Sequence<'a, B::State>>,
    cache: PrefixCache<B::State>,
}

impl<'a, B: Backend> EngineLoop<'a, B> {
    fn run(mut self) {
        loop {
            if self.waiting.is_empty() && self.running.is_empty() {
                match self.messages.blocking_recv() {
                    Some(message) => self.receive(message),
                    None => break,
                }
            }
            while let Ok(message) = self.messages.try_recv() {
                self.receive(message);
            }
            self.drop_cancelled();
            self.admit();
            self.prefill_step();
            self.decode_step();
            self.retire_finished();
        }
    }

    fn receive(&mut self, message: Message) {
        match message {
            Message::Submit(submission) => self.waiting.push_back(*submission),
            Message::CancelAll => self.fail_everything("the server is shutting down"),
        }
    }

    fn metrics(&self) -> &'a EngineMetrics {
        &self.shared.metrics
    }

    fn fail_everything(&mut self, message: &str) {
        let metrics = self.metrics();
        for s in self.waiting.drain(..) {
            metrics.waiting.fetch_sub(1, Ordering::AcqRel);
            let _ = s.events.send(Event::Failed(message.to_owned()));
        }
        for s in self.running.drain(..) {
            let _ = s.events.send(Event::Failed(message.to_owned()));
        }
        metrics.running.store(0, Ordering::Release);
    }

    /// Forgets requests whose client went away; a running one's state is freed here.
    fn drop_cancelled(&mut self) {
        let metrics = self.metrics();
        self.waiting.retain(|s| {
            let keep = !s.events.is_closed();
            if !keep {
                metrics.waiting.fetch_sub(1, Ordering::AcqRel);
                metrics.requests_cancelled.fetch_add(1, Ordering::Relaxed);
            }
            keep
        });
        for s in &mut self.running {
            if s.events.is_closed() && !s.done {
                s.done = true;
                metrics.requests_cancelled.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.retire_finished();
    }

    fn admit(&mut self) {
        let metrics = self.metrics();
        while self.running.len() < self.max_batch {
            let Some(submission) = self.waiting.pop_front() else {
                break;
            };
            metrics.waiting.fetch_sub(1, Ordering::AcqRel);
            let events = submission.events.clone();
            match self.start(submission) {
                Ok(sequence) => self.running.push(sequence),
                Err(e) => {
                    metrics.requests_failed.fetch_add(1, Ordering::Relaxed);
                    let _ = events.send(Event::Failed(format!("{e:#}")));
                }
            }
        }
        metrics.running.store(self.running.len(), Ordering::Release);
    }

    fn start(&self, submission: Submission) -> Result<Sequence<'a, B::State>> {
        let Submission {
            request,
            events,
            submitted,
        } = submission;
        let vocab = self.backend.config().vocab_size;
        anyhow::ensure!(!request.prompt.is_empty(), "the prompt is empty");
        if let Some(&bad) = request
            .prompt
            .iter()
            .chain(request.logit_bias.iter().map(|(id, _)| id))
            .find(|&&id| id as usize >= vocab)
        {
            anyhow::bail!("token id {bad} is outside the vocabulary (size {vocab})");
        }
        let sampler = Sampler::new(request.params.sampling.clone(), &request.prompt)?;
        // Bias, reported logprobs and grammars need the logits on the host.
        let reports_nothing = request.logprobs.is_none()
            && request.logit_bias.is_empty()
            && request.constraint.is_none();
        let sampling = &request.params.sampling;
        let device_greedy = sampling.is_greedy() && reports_nothing;
        let device_sampled = self.backend.samples_on_device()
            && sampling.is_drawable_on(self.backend.penalises_on_device())
            && reports_nothing;
        let mut cache_points: Vec<usize> = request
            .cache_points
            .into_iter()
            .filter(|&p| p >= MIN_CACHED_PREFIX && p <= request.prompt.len())
            .collect();
        cache_points.sort_unstable();
        cache_points.dedup();
        Ok(Sequence {
            state: self.backend.new_state()?,
            prompt: request.prompt,
            prefilled: 0,
            cache_points,
            cached_tokens: 0,
            sampler,
            output: Output::new(&request.params, self.tokenizer).skipping_special_tokens(),
            events,
            next_token: None,
            logprobs: request.logprobs,
            prompt_logprobs: request.prompt_logprobs,
            prompt_scores: Vec::new(),
            logit_bias: request.logit_bias,
            constraint: request.constraint,
            device_greedy,
            device_sampled,
            history_on_backend: false,
            submitted,
            first_token_sent: false,
            done: false,
            finished: false,
        })
    }

    /// Prefills up to `prefill_chunk` prompt tokens, oldest request first, stopping at each
    /// cache point to store a copy of the state. A sequence looks for a cached prefix when its
    /// prefill starts, not when it is admitted, so that requests admitted together (`n`
    /// choices, agents sharing a system prompt) find what the first of them stored.
    fn prefill_step(&mut self) {
        let mut budget = self.shared.options.prefill_chunk;
        let metrics = self.metrics();
        for s in self.running.iter_mut() {
            // A scored prompt needs every position's logits, so it prefills all of it itself.
            if budget > 0 && !s.done && s.prefilled == 0 && s.prompt_logprobs.is_none() {
                start_from_cache(&mut self.cache, self.backend, s, metrics);
            }
            while budget > 0 && !s.done && s.prefilled < s.prompt.len() {
                let point = s.cache_points.first().copied();
                // A scored chunk brings every row's logits back (1 MB a token at the 35B's
                // vocabulary): SCORED_CHUNK bounds that memory.
                let (most, which) = match s.prompt_logprobs {
                    Some(_) => (budget.min(SCORED_CHUNK), LogitsFor::All),
                    None => (budget, LogitsFor::Last),
                };
                let end = s
                    .prompt
                    .len()
                    .min(s.prefilled + most)
                    .min(point.unwrap_or(usize::MAX));
                let first = s.prefilled;
                let chunk = &s.prompt[first..end];
                let last = end == s.prompt.len();
                let start = Instant::now();
                let result = self.backend.prefill(&mut s.state, chunk, which);
                metrics
                    .prefill_micros
                    .fetch_add(start.elapsed().as_micros() as u64, Ordering::Relaxed);
                metrics
                    .prompt_tokens
                    .fetch_add(chunk.len() as u64, Ordering::Relaxed);
                budget -= chunk.len();
                s.prefilled = end;
                let mut logits = match result {
                    Ok(logits) => logits,
                    Err(e) => {
                        fail(s, &e, metrics);
                        break;
                    }
                };
                if let Some(k) = s.prompt_logprobs {
                    logits = score_prompt(s, first..end, logits, k, self.tokenizer);
                }
                if point == Some(end) {
                    s.cache_points.remove(0);
                    keep_copy(&mut self.cache, self.backend, &s.prompt[..end], &s.state);
                    metrics
                        .prefix_cache_entries
                        .store(self.cache.len(), Ordering::Relaxed);
                }
                if last {
                    if s.prompt_logprobs.is_some() {
                        let scores = std::mem::take(&mut s.prompt_scores);
                        // A client gone shows at the next drop_cancelled.
                        let _ = s.events.send(Event::PromptLogprobs(scores));
                    }
                    if s.output.max_tokens() == 0 {
                        finish(s, FinishReason::Length, metrics);
                        break;
                    }
                    match choose(s, &mut logits, self.tokenizer) {
                        Ok(chosen) => emit(s, chosen, metrics),
                        Err(e) => fail(s, &e, metrics),
                    }
                }
            }
        }
    }

    /// One batched decode step for every sequence past its prompt.
    fn decode_step(&mut self) {
        let metrics = self.metrics();
        let penalises = self.backend.penalises_on_device();
        let mut batch: Vec<&mut Sequence<'a, B::State>> = self
            .running
            .iter_mut()
            .filter(|s| !s.done && s.next_token.is_some())
            .collect();
        for s in batch.iter_mut() {
            let drawn_here = s.device_sampled && !s.holds_back_eos();
            if drawn_here && s.sampler.penalises() && !s.history_on_backend {
                let history = s.sampler.penalty_history();
                match self.backend.load_penalty_history(&mut s.state, &history) {
                    Ok(()) => s.history_on_backend = true,
                    Err(e) => fail(s, &e, metrics),
                }
            }
        }
        batch.retain(|s| !s.done);
        if batch.is_empty() {
            return;
        }
        let tokens: Vec<u32> = batch.iter().filter_map(|s| s.next_token).collect();
        // Padding rows past the tokenizer's vocabulary are never drawn.
        let allowed = self
            .tokenizer
            .map_or(self.backend.config().vocab_size, |t| t.vocab_size());
        // Each row's draw where the backend can make it: greedy rows take the one token a top-1
        // filter leaves; rows whose choice needs the logits on the host have none.
        let draws: Vec<Option<DeviceDraw>> = batch
            .iter_mut()
            .map(|s| {
                if s.holds_back_eos() {
                    None
                } else if s.device_sampled {
                    s.sampler.device_draw(allowed, penalises)
                } else {
                    s.device_greedy.then(|| DeviceDraw::most_likely(allowed))
                }
            })
            .collect();
        let drawn_rows = draws.iter().flatten().count();
        let all_greedy = batch.iter().all(|s| s.device_greedy && !s.holds_back_eos());
        let start = Instant::now();
        let mut states: Vec<&mut B::State> = batch.iter_mut().map(|s| &mut s.state).collect();
        let result = if all_greedy {
            self.backend
                .decode_greedy(&mut states, &tokens)
                .map(Chosen::Ids)
        } else if drawn_rows == 0 || !self.backend.samples_on_device() {
            self.backend
                .decode(&mut states, &tokens)
                .map(|logits| Chosen::Mixed(vec![None; tokens.len()], logits))
        } else if drawn_rows == draws.len() {
            let draws: Vec<DeviceDraw> = draws.into_iter().flatten().collect();
            self.backend
                .decode_sample(&mut states, &tokens, &draws)
                .map(|ids| Chosen::Mixed(ids.into_iter().map(Some).collect(), Vec::new()))
        } else {
            self.backend
                .decode_mixed(&mut states, &tokens, &draws)
                .map(|step| Chosen::Mixed(step.drawn, step.logits))
        };
        drop(states);
        metrics
            .decode_micros
            .fetch_add(start.elapsed().as_micros() as u64, Ordering::Relaxed);
        metrics.decode_steps.fetch_add(1, Ordering::Relaxed);
        metrics
            .decode_tokens
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        match result {
            Ok(Chosen::Ids(ids)) => {
                for (s, id) in batch.into_iter().zip(ids) {
                    emit(s, (id, None), metrics);
                }
            }
            Ok(Chosen::Mixed(drawn, mut logits)) => {
                let vocab = self.backend.config().vocab_size;
                let mut rows = logits.chunks_exact_mut(vocab);
                for (s, id) in batch.into_iter().zip(drawn) {
                    let chosen = match id {
                        Some(id) => {
                            s.sampler.record(id);
                            Ok((id, None))
                        }
                        None => match rows.next() {
                            Some(row) => choose(s, row, self.tokenizer),
                            None => Err(anyhow::anyhow!("the backend returned too few logits")),
                        },
                    };
                    match chosen {
                        Ok(chosen) => emit(s, chosen, metrics),
                        Err(e) => fail(s, &e, metrics),
                    }
                }
            }
            Err(e) => {
                for s in batch {
                    fail(s, &e, metrics);
                }
            }
        }
    }

    /// Drops the sequences that are done; one that finished leaves its state to the prefix
    /// cache, keyed by the tokens it fed to the model (the prompt and every chosen token but the
    /// last, which ended it).
    fn retire_finished(&mut self) {
        let (done, running) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|s| s.done);
        self.running = running;
        let keep = self.cache.is_enabled();
        for s in done.into_iter().filter(|s| keep && s.finished) {
            let mut fed = s.prompt;
            fed.extend_from_slice(&s.output.ids[..s.output.ids.len().saturating_sub(1)]);
            if fed.len() >= MIN_CACHED_PREFIX && !self.cache.contains(&fed) {
                self.cache.insert(fed, s.state);
            }
        }
        let metrics = self.metrics();
        metrics.running.store(self.running.len(), Ordering::Release);
        metrics
            .prefix_cache_entries
            .store(self.cache.len(), Ordering::Relaxed);
    }
}

/// Moves `s` onto a copy of the longest cached prefix of its prompt, if there is one. A failed
/// copy only costs the reuse: the sequence keeps its fresh state.
fn start_from_cache<B: Backend>(
    cache: &mut PrefixCache<B::State>,
    backend: &B,
    s: &mut Sequence<'_, B::State>,
    metrics: &EngineMetrics,
) {
    let Some((cached, state)) = cache.longest_prefix(&s.prompt) else {
        return;
    };
    match backend.fork(state) {
        Ok(state) => {
            s.state = state;
            s.prefilled = cached;
            s.cached_tokens = cached;
            s.cache_points.retain(|&p| p > cached);
            metrics.prefix_cache_hits.fetch_add(1, Ordering::Relaxed);
            metrics
                .cached_prompt_tokens
                .fetch_add(cached as u64, Ordering::Relaxed);
        }
        Err(e) => tracing::warn!(
            error = format!("{e:#}"),
            "cannot copy a cached prefix; prefilling the whole prompt"
        ),
    }
}

/// The states the prefix cache may keep: what was asked for, within what a backend with a fixed
/// pool of states has beside the running sequences and the copy a starting sequence takes.
fn cache_capacity(max_batch: usize, prefix_cache: usize, max_states: Option<usize>) -> usize {
    let Some(states) = max_states else {
        return prefix_cache;
    };
    let spare = states.saturating_sub(max_batch + 1);
    if spare < prefix_cache {
        tracing::warn!(
            asked = prefix_cache,
            kept = spare,
            "the backend has room for fewer prefix-cache states than asked for"
        );
    }
    spare.min(prefix_cache)
}

/// Stores a copy of `state`, the state after `tokens`, unless the cache holds one already. A
/// failed copy (no free state on the device) only costs the entry.
fn keep_copy<B: Backend>(
    cache: &mut PrefixCache<B::State>,
    backend: &B,
    tokens: &[u32],
    state: &B::State,
) {
    if !cache.is_enabled() || cache.contains(tokens) {
        return;
    }
    cache.make_room();
    match backend.fork(state) {
        Ok(copy) => cache.insert(tokens.to_vec(), copy),
        Err(e) => tracing::warn!(
            error = format!("{e:#}"),
            "cannot copy a state into the prefix cache"
        ),
    }
}

enum Chosen {
    /// The backend's argmax.
    Ids(Vec<u32>),
    /// Each row's draw by the backend (the samplers record them), or `None` for the rows whose
    /// logits follow, in order, for the host to choose from.
    Mixed(Vec<Option<u32>>, Vec<f32>),
}

/// Samples the next token of `s` from its logits, with the requested log-probabilities.
fn choose<S>(
    s: &mut Sequence<'_, S>,
    logits: &mut [f32],
    tokenizer: Option<&Tokenizer>,
) -> Result<(u32, Option<TokenLogprobs>)> {
    for &(id, bias) in &s.logit_bias {
        logits[id as usize] += bias;
    }
    if s.holds_back_eos() {
        for &id in s.output.eos_token_ids() {
            if let Some(l) = logits.get_mut(id as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    mask_padding(logits, tokenizer);
    if let Some(c) = &mut s.constraint {
        c.mask(logits)?;
    }
    let sampled = s.sampler.sample(logits)?;
    // The backend's penalty history lacks this token.
    s.history_on_backend = false;
    if let Some(c) = &mut s.constraint {
        c.advance(sampled.token_id)?;
    }
    let logprobs = s.logprobs.map(|k| TokenLogprobs {
        logprob: sampled.logprob,
        top: top_logprobs(logits, k),
    });
    Ok((sampled.token_id, logprobs))
}

/// Rows past the tokenizer's vocabulary (padding of the embedding) are not tokens.
fn mask_padding(logits: &mut [f32], tokenizer: Option<&Tokenizer>) {
    if let Some(t) = tokenizer
        && t.vocab_size() < logits.len()
        && logits[..t.vocab_size()].iter().any(|l| l.is_finite())
    {
        logits[t.vocab_size()..].fill(f32::NEG_INFINITY);
    }
}

/// Scores the prompt tokens that the rows of a prefilled chunk (the logits at prompt positions
/// `chunk`) predict into `s.prompt_scores`, and gives back the last row: the next token's logits.
fn score_prompt<S>(
    s: &mut Sequence<'_, S>,
    chunk: std::ops::Range<usize>,
    mut logits: Vec<f32>,
    k: usize,
    tokenizer: Option<&Tokenizer>,
) -> Vec<f32> {
    let vocab = logits.len() / chunk.len();
    for (row, position) in logits.chunks_mut(vocab).zip(chunk.start + 1..) {
        let Some(&next) = s.prompt.get(position) else {
            break;
        };
        mask_padding(row, tokenizer);
        let (logprob, top) = logprob_and_top(row, next, k);
        s.prompt_scores.push(TokenLogprobs { logprob, top });
    }
    logits.split_off(logits.len() - vocab)
}

/// Ends `s` before it writes a token (`max_tokens` 0: the prompt was only scored).
fn finish<S>(s: &mut Sequence<'_, S>, reason: FinishReason, metrics: &EngineMetrics) {
    s.done = true;
    s.finished = true;
    metrics.requests_finished.fetch_add(1, Ordering::Relaxed);
    let _ = s.events.send(Event::Finished {
        reason,
        completion_tokens: s.output.ids.len(),
        cached_tokens: s.cached_tokens,
    });
}

/// Records the chosen token of `s` and sends its event (and the finish, if it ends here).
fn emit<S>(
    s: &mut Sequence<'_, S>,
    (id, logprobs): (u32, Option<TokenLogprobs>),
    metrics: &EngineMetrics,
) {
    if !s.first_token_sent {
        s.first_token_sent = true;
        metrics.time_to_first_token.observe(s.submitted.elapsed());
    }
    metrics.generated_tokens.fetch_add(1, Ordering::Relaxed);
    let pushed = match s.output.push(id) {
        Ok(pushed) => pushed,
        Err(e) => return fail(s, &e, metrics),
    };
    let sent = s.events.send(Event::Token {
        id,
        text: pushed.text,
        logprobs,
    });
    if sent.is_err() {
        s.done = true;
        metrics.requests_cancelled.fetch_add(1, Ordering::Relaxed);
        return;
    }
    match pushed.finish {
        Some(reason) => finish(s, reason, metrics),
        None => s.next_token = Some(id),
    }
}

fn fail<S>(s: &mut Sequence<'_, S>, error: &anyhow::Error, metrics: &EngineMetrics) {
    tracing::warn!(error = format!("{error:#}"), "a sequence failed");
    s.done = true;
    metrics.requests_failed.fetch_add(1, Ordering::Relaxed);
    let _ = s.events.send(Event::Failed(format!("{error:#}")));
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::atomic::AtomicUsize;

    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::{MixedStep, PenaltyHistory, argmax};
    use crate::engine::generate::GenerationParams;
    use crate::engine::sampler::SamplingParams;
    use crate::engine::sampler::logprob_of;
    use crate::model::Model;
    use crate::model::demo::demo;

    /// The CPU backend drawing tokens itself, as the CUDA backend does (Gumbel-max at the draw's
    /// temperature, the noise a hash of the seed and the id; the top-k/p and min-p filters,
    /// which these tests leave off, are not applied), counting the mixed steps it took; with
    /// `penalises`, it applies penalties over a history per sequence as the CUDA backend does.
    struct DrawingCpu {
        cpu: CpuBackend,
        mixed_steps: Arc<AtomicUsize>,
        /// `Backend::max_states`.
        states: Option<usize>,
        /// `Backend::penalises_on_device`.
        penalises: bool,
        /// Calls of `Backend::load_penalty_history`.
        history_loads: Arc<AtomicUsize>,
    }

    impl DrawingCpu {
        fn new(model: Arc<Model>) -> Self {
            Self {
                cpu: CpuBackend::new(model),
                mixed_steps: Arc::new(AtomicUsize::new(0)),
                states: None,
                penalises: false,
                history_loads: Arc::new(AtomicUsize::new(0)),
            }
        }

        fn cpu_states<'s>(states: &'s mut [&mut DrawingState]) -> Vec<&'s mut CpuState> {
            states.iter_mut().map(|s| &mut s.cpu).collect()
        }
    }

    type CpuState = <CpuBackend as Backend>::State;

    /// A [`DrawingCpu`] sequence: the CPU backend's state and the penalty history, a word per
    /// id seen (as `Slot::history` of the CUDA backend: bit 31 once seen, the low bits the
    /// times generated).
    struct DrawingState {
        cpu: CpuState,
        history: HashMap<u32, u32>,
    }

    const SEEN: u32 = 1 << 31;

    fn draw(logits: &[f32], d: &DeviceDraw, history: &mut HashMap<u32, u32>) -> u32 {
        let mut logits = logits[..d.allowed].to_vec();
        let p = d.penalties;
        if !p.is_none() {
            for (&id, &word) in history.iter() {
                let l = &mut logits[id as usize];
                if word & SEEN != 0 {
                    *l = if *l > 0.0 {
                        *l / p.repetition
                    } else {
                        *l * p.repetition
                    };
                }
                let generated = word & !SEEN;
                if generated > 0 {
                    *l -= p.presence + p.frequency * generated as f32;
                }
            }
        }
        let id = if d.top_k == 1 || d.greedy {
            argmax(&logits)
        } else {
            let noisy: Vec<f32> = logits
                .iter()
                .enumerate()
                .map(|(i, l)| {
                    let mut h = d.seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    h = (h ^ (h >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                    h ^= h >> 29;
                    let u = ((h >> 40) as f32 + 0.5) / (1u64 << 24) as f32;
                    l / d.temperature - (-u.ln()).ln()
                })
                .collect();
            argmax(&noisy)
        };
        if !p.is_none() {
            let word = history.entry(id).or_insert(0);
            *word = (*word + 1) | SEEN;
        }
        id
    }

    impl Backend for DrawingCpu {
        type State = DrawingState;

        fn config(&self) -> &crate::config::ModelConfig {
            self.cpu.config()
        }

        fn new_state(&self) -> Result<Self::State> {
            Ok(DrawingState {
                cpu: self.cpu.new_state()?,
                history: HashMap::new(),
            })
        }

        fn fork(&self, state: &Self::State) -> Result<Self::State> {
            Ok(DrawingState {
                cpu: self.cpu.fork(&state.cpu)?,
                history: state.history.clone(),
            })
        }

        fn prefill(
            &self,
            state: &mut Self::State,
            tokens: &[u32],
            which: LogitsFor,
        ) -> Result<Vec<f32>> {
            self.cpu.prefill(&mut state.cpu, tokens, which)
        }

        fn decode(&self, states: &mut [&mut Self::State], tokens: &[u32]) -> Result<Vec<f32>> {
            self.cpu.decode(&mut Self::cpu_states(states), tokens)
        }

        fn max_states(&self) -> Option<usize> {
            self.states
        }

        fn samples_on_device(&self) -> bool {
            true
        }

        fn penalises_on_device(&self) -> bool {
            self.penalises
        }

        fn load_penalty_history(
            &self,
            state: &mut Self::State,
            history: &PenaltyHistory,
        ) -> Result<()> {
            anyhow::ensure!(self.penalises, "no penalties here");
            self.history_loads.fetch_add(1, Ordering::Relaxed);
            state.history = history.seen.iter().map(|&id| (id, SEEN)).collect();
            for &(id, count) in &history.generated {
                state.history.insert(id, SEEN | count);
            }
            Ok(())
        }

        fn decode_sample(
            &self,
            states: &mut [&mut Self::State],
            tokens: &[u32],
            draws: &[DeviceDraw],
        ) -> Result<Vec<u32>> {
            let logits = self.cpu.decode(&mut Self::cpu_states(states), tokens)?;
            let rows = logits.chunks_exact(self.config().vocab_size);
            Ok(rows
                .zip(draws)
                .zip(states.iter_mut())
                .map(|((row, d), s)| draw(row, d, &mut s.history))
                .collect())
        }

        fn decode_mixed(
            &self,
            states: &mut [&mut Self::State],
            tokens: &[u32],
            draws: &[Option<DeviceDraw>],
        ) -> Result<MixedStep> {
            self.mixed_steps.fetch_add(1, Ordering::Relaxed);
            let all = self.cpu.decode(&mut Self::cpu_states(states), tokens)?;
            let mut step = MixedStep {
                drawn: Vec::new(),
                logits: Vec::new(),
            };
            let rows = all.chunks_exact(self.config().vocab_size);
            for ((row, d), s) in rows.zip(draws).zip(states.iter_mut()) {
                step.drawn
                    .push(d.as_ref().map(|d| draw(row, d, &mut s.history)));
                if d.is_none() {
                    step.logits.extend_from_slice(row);
                }
            }
            Ok(step)
        }
    }

    /// The engine limits of these tests: four sequences at once, no prefix cache.
    const TEST_OPTIONS: EngineOptions = EngineOptions {
        max_batch: 4,
        max_queue: 8,
        prefill_chunk: 512,
        prefix_cache: 0,
    };

    fn request(prompt: Vec<u32>, temperature: f32, logprobs: Option<usize>) -> GenerationRequest {
        GenerationRequest {
            prompt,
            cache_points: Vec::new(),
            params: GenerationParams {
                max_tokens: 12,
                sampling: SamplingParams {
                    temperature,
                    seed: Some(11),
                    ..SamplingParams::default()
                },
                stop: Vec::new(),
                eos_token_ids: Vec::new(),
                end_after_ids: Vec::new(),
                min_tokens: 0,
            },
            logprobs,
            prompt_logprobs: None,
            logit_bias: Vec::new(),
            constraint: None,
        }
    }

    /// The ids of each request's reply, and whether every token came with logprobs.
    fn replies(engine: &Engine, requests: &[GenerationRequest]) -> Vec<(Vec<u32>, bool)> {
        let mut receivers: Vec<_> = requests
            .iter()
            .map(|r| engine.handle().submit(r.clone()).unwrap())
            .collect();
        receivers
            .iter_mut()
            .map(|events| {
                let (mut ids, mut reported) = (Vec::new(), true);
                while let Some(event) = events.blocking_recv() {
                    match event {
                        Event::Token { id, logprobs, .. } => {
                            ids.push(id);
                            reported &= logprobs.is_some();
                        }
                        Event::PromptLogprobs(_) => {}
                        Event::Finished { .. } => break,
                        Event::Failed(e) => panic!("{e}"),
                    }
                }
                (ids, reported)
            })
            .collect()
    }

    /// A greedy and a sampled request beside one whose logprobs need the host: the step draws
    /// the first two on the backend and returns the third's logits alone, and each reply is
    /// the one it gets running alone (the same draws, in the same order).
    #[test]
    fn a_row_that_needs_its_logits_leaves_the_other_rows_drawn_on_the_backend() {
        let model = Arc::new(demo().unwrap().model);
        let mixed_steps = Arc::new(AtomicUsize::new(0));
        let counter = mixed_steps.clone();
        let engine = Engine::start(
            move || {
                Ok(DrawingCpu {
                    mixed_steps: counter,
                    ..DrawingCpu::new(model)
                })
            },
            None,
            TEST_OPTIONS,
        )
        .unwrap();
        let requests = [
            request(vec![72, 101, 108, 108, 111], 0.0, None),
            request(vec![87, 111, 114, 108, 100, 33], 0.9, None),
            request(vec![66, 121, 101], 0.0, Some(2)),
        ];
        let alone: Vec<_> = requests
            .iter()
            .map(|r| replies(&engine, std::slice::from_ref(r)).remove(0))
            .collect();
        assert_eq!(mixed_steps.load(Ordering::Relaxed), 0);
        let together = replies(&engine, &requests);
        assert!(mixed_steps.load(Ordering::Relaxed) > 0);
        assert_eq!(together, alone);
        assert_eq!(
            together
                .iter()
                .map(|(ids, _)| ids.len())
                .collect::<Vec<_>>(),
            [12, 12, 12]
        );
        assert!(together[2].1 && !together[0].1 && !together[1].1);
        engine.join();
    }

    /// A scored prompt (longer than two scored chunks): every
    /// token after the first gets the log-softmax of the logits one prefill of the whole prompt
    /// gives at the position before it, with its top alternatives; `max_tokens` 0 ends it there,
    /// and with tokens to write the reply is the unscored request's.
    #[test]
    fn a_scored_prompt_reports_each_tokens_logprob_given_those_before_it() {
        let model = Arc::new(demo().unwrap().model);
        let reference = CpuBackend::new(model.clone());
        let engine = Engine::start(
            move || Ok(CpuBackend::new(model)),
            None,
            EngineOptions {
                prefill_chunk: 1000,
                prefix_cache: 2,
                ..TEST_OPTIONS
            },
        )
        .unwrap();
        // Chunks of SCORED_CHUNK, SCORED_CHUNK and the rest.
        let prompt: Vec<u32> = (0..2 * SCORED_CHUNK + 88)
            .map(|i| (i * 37 % 200 + 1) as u32)
            .collect();
        let mut state = reference.new_state().unwrap();
        let all = reference
            .prefill(&mut state, &prompt, LogitsFor::All)
            .unwrap();
        let vocab = reference.config().vocab_size;

        let mut scored = request(prompt.clone(), 0.0, None);
        scored.prompt_logprobs = Some(3);
        scored.params.max_tokens = 0;
        let mut events = engine.handle().submit(scored.clone()).unwrap();
        let Some(Event::PromptLogprobs(scores)) = events.blocking_recv() else {
            panic!("no prompt logprobs first");
        };
        assert!(matches!(
            events.blocking_recv(),
            Some(Event::Finished {
                reason: FinishReason::Length,
                completion_tokens: 0,
                ..
            })
        ));
        assert_eq!(scores.len(), prompt.len() - 1);
        for (p, score) in scores.iter().enumerate() {
            let row = &all[p * vocab..(p + 1) * vocab];
            let expected = logprob_of(row, prompt[p + 1]);
            assert!((score.logprob - expected).abs() < 1e-3, "position {p}");
            assert_eq!(score.top.len(), 3);
            let best = top_logprobs(row, 1)[0].token_id;
            assert_eq!(score.top[0].token_id, best, "position {p}");
            assert!(score.top[0].logprob >= score.logprob);
        }

        scored.params.max_tokens = 12;
        let replies = replies(&engine, &[scored, request(prompt, 0.0, None)]);
        assert_eq!(replies[0].0.len(), 12);
        assert_eq!(replies[0].0, replies[1].0);
        engine.join();
    }

    /// Penalised requests on a backend that applies the penalties itself are drawn there, and
    /// (greedy, so the choice is exact) give the replies of the host's sampler: the backend
    /// holds the prompt and every token chosen before its first draw, those the host chose
    /// while `min_tokens` held the end back among them, and counts its own choices.
    #[test]
    fn penalised_draws_on_the_backend_give_the_hosts_replies() {
        let model = Arc::new(demo().unwrap().model);
        let loads = Arc::new(AtomicUsize::new(0));
        let start = |penalises: bool| {
            let (model, loads) = (model.clone(), loads.clone());
            Engine::start(
                move || {
                    Ok(DrawingCpu {
                        penalises,
                        history_loads: loads,
                        ..DrawingCpu::new(model)
                    })
                },
                None,
                TEST_OPTIONS,
            )
            .unwrap()
        };
        let penalised = |prompt: Vec<u32>, min_tokens: usize| {
            let mut r = request(prompt, 0.0, None);
            // Seen ids favoured (generated ones until they repeat a few times): the demo
            // model's greedy replies do not repeat an id on their own.
            r.params.sampling.repetition_penalty = 0.2;
            r.params.sampling.presence_penalty = -2.0;
            r.params.sampling.frequency_penalty = 0.7;
            r.params.min_tokens = min_tokens;
            r
        };
        let requests = [
            penalised(vec![72, 101, 108, 108, 111], 0),
            penalised(vec![87, 111, 114, 108, 100, 33], 4),
        ];
        let host = start(false);
        let expected = replies(&host, &requests);
        let plain = replies(&host, &[request(requests[0].prompt.clone(), 0.0, None)]);
        host.join();
        assert_eq!(loads.load(Ordering::Relaxed), 0);
        assert_ne!(expected[0], plain[0], "the penalties change the reply");

        let backend = start(true);
        let alone: Vec<_> = requests
            .iter()
            .map(|r| replies(&backend, std::slice::from_ref(r)).remove(0))
            .collect();
        assert_eq!(alone, expected);
        assert_eq!(
            loads.load(Ordering::Relaxed),
            2,
            "a history load per request"
        );
        assert_eq!(replies(&backend, &requests), expected);
        backend.join();
    }

    #[test]
    fn the_cache_keeps_what_the_backends_pool_has_room_for() {
        assert_eq!(cache_capacity(32, 8, None), 8);
        // The running sequences and one starting copy come first.
        assert_eq!(cache_capacity(32, 8, Some(32 + 1 + 8)), 8);
        assert_eq!(cache_capacity(32, 8, Some(32 + 1 + 3)), 3);
        assert_eq!(cache_capacity(32, 8, Some(32 + 1)), 0);
        assert_eq!(cache_capacity(32, 8, Some(4)), 0);
        assert_eq!(cache_capacity(32, 0, Some(100)), 0);
    }

    /// A backend whose pool holds fewer states than `max_batch` (a GPU fitted to its free
    /// memory) runs that many sequences at once and queues the rest, which still finish.
    #[test]
    fn a_smaller_pool_of_states_lowers_the_batch() {
        let model = Arc::new(demo().unwrap().model);
        let engine = Engine::start(
            move || {
                Ok(DrawingCpu {
                    states: Some(2),
                    ..DrawingCpu::new(model)
                })
            },
            None,
            EngineOptions {
                prefix_cache: 4,
                ..TEST_OPTIONS
            },
        )
        .unwrap();
        assert_eq!(engine.handle().max_batch(), 2);
        let requests: Vec<_> = (0..3)
            .map(|i| request(vec![72 + i, 101, 108], 0.0, None))
            .collect();
        let together = replies(&engine, &requests);
        assert!(together.iter().all(|(ids, _)| ids.len() == 12));
        engine.join();
    }
}

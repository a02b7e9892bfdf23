//! Backends that execute the model. Each implements prefill (a whole prompt, matrix-matrix) and
//! decode (one token for each of a batch of sequences) over its own sequence state.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use anyhow::Result;

use crate::config::ModelConfig;

/// Which prompt positions prefill returns logits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsFor {
    /// Only the last position (generation).
    Last,
    /// Every position (scoring, tests).
    All,
}

/// One sequence's draw for a backend that samples on its own: the penalties and filters a host
/// [`crate::engine::sampler::Sampler`] applies, and this step's seed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceDraw {
    /// Above zero.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    /// Ids at or above this are never drawn (rows that pad the vocabulary).
    pub allowed: usize,
    /// Applied to the logits first, over the history the backend holds for the sequence (see
    /// [`Backend::load_penalty_history`]); a backend that applies them also counts each id it
    /// chooses in that history.
    pub penalties: Penalties,
    /// Takes the most likely id (of the penalised logits, the lowest on ties) instead of
    /// drawing: greedy decoding with penalties. The temperature and filters are then off.
    pub greedy: bool,
    pub seed: u64,
}

impl DeviceDraw {
    /// The draw that always takes the most likely of the ids below `allowed` (top-1).
    pub fn most_likely(allowed: usize) -> Self {
        Self {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
            min_p: 0.0,
            allowed,
            penalties: Penalties::NONE,
            greedy: false,
            seed: 0,
        }
    }
}

/// The penalties of [`crate::engine::sampler::SamplingParams`] on the ids a sequence has seen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Penalties {
    /// Positive logits of seen ids (prompt or generated) divided by it, negative ones multiplied.
    pub repetition: f32,
    /// Subtracted from the logit of every id generated at least once.
    pub presence: f32,
    /// Subtracted once per time the id was generated.
    pub frequency: f32,
}

impl Penalties {
    pub const NONE: Self = Self {
        repetition: 1.0,
        presence: 0.0,
        frequency: 0.0,
    };

    pub fn is_none(&self) -> bool {
        *self == Self::NONE
    }
}

/// What the penalties of a sequence's next tokens depend on (see
/// [`Backend::load_penalty_history`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PenaltyHistory {
    /// Every distinct id of the prompt and of the generated tokens.
    pub seen: Vec<u32>,
    /// Each generated id with how many times it was generated.
    pub generated: Vec<(u32, u32)>,
}

/// What [`Backend::decode_mixed`] chose: the drawn rows' ids, the other rows' logits.
#[derive(Clone, Debug, PartialEq)]
pub struct MixedStep {
    /// Each row's drawn id, `None` for the rows left to the host.
    pub drawn: Vec<Option<u32>>,
    /// The logits of the rows left to the host, in batch order, row-major `[rows, vocab]`.
    pub logits: Vec<f32>,
}

/// An executor of the model.
pub trait Backend {
    /// Per-sequence state (caches).
    type State: Send;

    fn config(&self) -> &ModelConfig;

    /// A fresh state for a new sequence.
    fn new_state(&self) -> Result<Self::State>;

    /// How many states can exist at once, where the backend holds a fixed pool of them (`None`:
    /// as many as host memory allows).
    fn max_states(&self) -> Option<usize> {
        None
    }

    /// An independent copy of a sequence's state (prefix caching, speculative decoding).
    fn fork(&self, state: &Self::State) -> Result<Self::State>;

    /// Appends `tokens` to the sequence and returns logits, row-major `[rows, vocab]`, for the
    /// positions `which` asks for.
    fn prefill(
        &self,
        state: &mut Self::State,
        tokens: &[u32],
        which: LogitsFor,
    ) -> Result<Vec<f32>>;

    /// Appends one token to each sequence and returns their next-token logits, `[batch, vocab]`.
    fn decode(&self, states: &mut [&mut Self::State], tokens: &[u32]) -> Result<Vec<f32>>;

    /// Whether [`Backend::decode_sample`] works: the backend draws tokens itself.
    fn samples_on_device(&self) -> bool {
        false
    }

    /// Appends one token to each sequence and draws each one's next token as `draws` say, on
    /// the backend itself, so logits never leave it (see [`Backend::samples_on_device`]).
    fn decode_sample(
        &self,
        _states: &mut [&mut Self::State],
        _tokens: &[u32],
        _draws: &[DeviceDraw],
    ) -> Result<Vec<u32>> {
        anyhow::bail!("this backend does not draw tokens itself: sample from `decode`'s logits")
    }

    /// Whether the draws of [`Backend::decode_sample`] and [`Backend::decode_mixed`] may carry
    /// penalties, which the backend then applies over the history it holds for each sequence.
    fn penalises_on_device(&self) -> bool {
        false
    }

    /// Replaces the history the backend holds for the sequence's penalised draws (see
    /// [`Backend::penalises_on_device`]). It then counts each id its penalised draws choose,
    /// so the history needs loading again only after an id chosen elsewhere (on the host).
    fn load_penalty_history(
        &self,
        _state: &mut Self::State,
        _history: &PenaltyHistory,
    ) -> Result<()> {
        anyhow::bail!("this backend does not apply penalties itself: sample from the logits")
    }

    /// Appends one token to each sequence; a row with a draw gets its next token drawn on the
    /// backend (as [`Backend::decode_sample`]), a row without one its logits back for the host
    /// to choose from (a grammar, a logit bias or reported logprobs need them). So one such
    /// request in a batch brings its own logits to the host, not every row's, and the drawn rows
    /// take the same draws as in a batch of drawn rows alone.
    fn decode_mixed(
        &self,
        _states: &mut [&mut Self::State],
        _tokens: &[u32],
        _draws: &[Option<DeviceDraw>],
    ) -> Result<MixedStep> {
        anyhow::bail!("this backend does not draw tokens itself: sample from `decode`'s logits")
    }

    /// Appends one token to each sequence and returns each one's most likely next token.
    /// Backends that can pick on the device override this so logits never leave it.
    fn decode_greedy(&self, states: &mut [&mut Self::State], tokens: &[u32]) -> Result<Vec<u32>> {
        let logits = self.decode(states, tokens)?;
        Ok(logits
            .chunks_exact(self.config().vocab_size)
            .map(argmax)
            .collect())
    }

    /// Decodes one sequence to its end: appends `token`, passes the chosen id to `on_token`,
    /// and while that returns `Ok(true)` appends the id and goes on, each step choosing as
    /// `choice` says. It takes the state because a backend may already have appended the last
    /// id passed when `on_token` says stop: one that queues each step before reading the
    /// previous one's id back, so that the host's round trip and `on_token`'s own work overlap
    /// the device's. (The CUDA backend takes this step-by-step version: its pipelined one
    /// measured 3-6% slower, `docs/BENCHMARKS.md`, thirty-third session.)
    fn decode_run(
        &self,
        mut state: Self::State,
        mut token: u32,
        mut choice: RunChoice<'_>,
        on_token: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<()> {
        loop {
            token = match &mut choice {
                RunChoice::Greedy => self.decode_greedy(&mut [&mut state], &[token])?[0],
                RunChoice::Drawn(next) => {
                    self.decode_sample(&mut [&mut state], &[token], &[next()])?[0]
                }
            };
            if !on_token(token)? {
                return Ok(());
            }
        }
    }
}

/// How the steps of a [`Backend::decode_run`] choose their tokens.
pub enum RunChoice<'a> {
    /// The most likely token.
    Greedy,
    /// A draw on the backend ([`Backend::decode_sample`]), each step's made by this.
    Drawn(&'a mut dyn FnMut() -> DeviceDraw),
}

/// Index of the largest value; ties go to the lowest index (as torch.argmax).
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

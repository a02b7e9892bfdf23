//! Backends that execute the model. Each implements prefill (a whole prompt, matrix-matrix) and
//! decode (one token for each of a batch of sequences) over its own sequence state.

pub mod cpu;

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

/// An executor of the model.
pub trait Backend {
    /// Per-sequence state (caches); cloning forks a sequence.
    type State: Clone + Send;

    fn config(&self) -> &ModelConfig;

    /// A fresh state for a new sequence.
    fn new_state(&self) -> Self::State;

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
}

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

/// An executor of the model.
pub trait Backend {
    /// Per-sequence state (caches).
    type State: Send;

    fn config(&self) -> &ModelConfig;

    /// A fresh state for a new sequence.
    fn new_state(&self) -> Result<Self::State>;

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

    /// Appends one token to each sequence and returns each one's most likely next token.
    /// Backends that can pick on the device override this so logits never leave it.
    fn decode_greedy(&self, states: &mut [&mut Self::State], tokens: &[u32]) -> Result<Vec<u32>> {
        let logits = self.decode(states, tokens)?;
        Ok(logits
            .chunks_exact(self.config().vocab_size)
            .map(argmax)
            .collect())
    }
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

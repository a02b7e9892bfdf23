//! The model, described once for every backend: weights and per-sequence state.

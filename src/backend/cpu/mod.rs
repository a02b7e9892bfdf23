//! The CPU backend: the plain, readable reference every fast path is checked against.
//!
//! Computes in f32 (weights are converted from their stored dtype, or dequantised, as they are
//! read: the embedding a row per token, every matrix product a block of rows per task), with
//! matrix products and per-head work spread over threads by rayon. The forward pass, top to
//! bottom: embedding; per layer RMSNorm, token mixer (Gated DeltaNet or gated attention),
//! residual, RMSNorm, sparse MoE with shared expert, residual; final RMSNorm; lm_head.

mod attention;
mod deltanet;
mod moe;
mod ops;

use std::sync::{Arc, Mutex, PoisonError};

use anyhow::{Result, ensure};

use self::attention::KvCache;
use self::deltanet::DeltaNetState;
use self::ops::{add_in_place, matmul, rms_norm};
use super::{Backend, LogitsFor};
use crate::config::ModelConfig;
use crate::model::state::{LayerState, SequenceState};
use crate::model::{Mixer, Model};

/// Runs a [`Model`] on the CPU.
pub struct CpuBackend {
    model: Arc<Model>,
    bf16_activations: bool,
    routing_margins: Mutex<Vec<f32>>,
}

impl CpuBackend {
    pub fn new(model: Arc<Model>) -> Self {
        Self {
            model,
            bf16_activations: false,
            routing_margins: Mutex::default(),
        }
    }

    /// A variant that rounds the normalised inputs of every block (and of lm_head) to bf16:
    /// the spread between it and the f32 backend calibrates tolerances for GPU backends.
    pub fn with_bf16_activations(model: Arc<Model>) -> Self {
        Self {
            model,
            bf16_activations: true,
            routing_margins: Mutex::default(),
        }
    }

    /// For each token row of the last prefill or decode call: its narrowest routing margin over
    /// the MoE layers, the gap between the router logits of the last expert chosen and the first
    /// left out, relative to the row's largest |logit|. A backend whose rounding differs by more
    /// than that may route the token to another expert, a jump no float tolerance covers, so
    /// comparisons against this backend leave such rows out.
    pub fn routing_margins(&self) -> Vec<f32> {
        self.routing_margins
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn record_routing_margins(&self, margins: Vec<f32>) {
        *self
            .routing_margins
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = margins;
    }

    /// RMSNorm of the rows of `x`, rounded to bf16 in the calibration variant.
    fn norm(&self, x: &[f32], scale: &[f32]) -> Vec<f32> {
        let mut h = rms_norm(x, scale, self.model.config.rms_norm_eps);
        if self.bf16_activations {
            h.iter_mut()
                .for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
        }
        h
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let vocab = self.model.config.vocab_size;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            anyhow::bail!("token id {bad} is outside the vocabulary (size {vocab})");
        }
        Ok(())
    }

    /// Embedding rows of `tokens`, as f32.
    fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        let h = self.model.config.hidden_size;
        let mut x = vec![0.0f32; tokens.len() * h];
        for (row, &t) in x.chunks_exact_mut(h).zip(tokens) {
            self.model.embed_tokens.rows_to_f32(t as usize, row);
        }
        x
    }

    /// The MoE half of layer `l`, with its residual, over `n` rows (lowering `margins`, see
    /// `routing_margins`).
    fn feed_forward(&self, l: usize, x: &mut [f32], n: usize, margins: &mut [f32]) {
        let (c, layer) = (&self.model.config, &self.model.layers[l]);
        let h = self.norm(x, &layer.post_attention_norm);
        add_in_place(x, &moe::forward(c, &layer.moe, &h, n, margins));
    }

    /// Final norm and lm_head over `n` rows.
    fn logits(&self, x: Vec<f32>, n: usize) -> Vec<f32> {
        let h = self.norm(&x, &self.model.final_norm);
        matmul(&h, n, &self.model.lm_head)
    }
}

impl Backend for CpuBackend {
    type State = SequenceState;

    fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    fn new_state(&self) -> Result<SequenceState> {
        Ok(SequenceState::new(&self.model.config))
    }

    fn fork(&self, state: &SequenceState) -> Result<SequenceState> {
        Ok(state.clone())
    }

    fn prefill(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        which: LogitsFor,
    ) -> Result<Vec<f32>> {
        ensure!(!tokens.is_empty(), "prefill needs at least one token");
        self.check_tokens(tokens)?;
        let (m, c) = (&self.model, &self.model.config);
        let n = tokens.len();
        let mut x = self.embed(tokens);
        let mut margins = vec![f32::INFINITY; n];
        for (l, layer) in m.layers.iter().enumerate() {
            let h = self.norm(&x, &layer.input_norm);
            let mixed = match (&layer.mixer, &mut state.layers[l]) {
                (Mixer::Attention(w), LayerState::Attention { keys, values }) => {
                    attention::forward(c, w, &h, n, state.position, KvCache { keys, values })
                }
                (Mixer::DeltaNet(w), LayerState::DeltaNet { conv, recurrent }) => {
                    deltanet::prefill(c, w, &h, n, DeltaNetState { conv, recurrent })
                }
                _ => anyhow::bail!("sequence state does not match layer {l} of the model"),
            };
            add_in_place(&mut x, &mixed);
            self.feed_forward(l, &mut x, n, &mut margins);
        }
        self.record_routing_margins(margins);
        state.position += n;
        Ok(match which {
            LogitsFor::All => self.logits(x, n),
            LogitsFor::Last => {
                let h = c.hidden_size;
                self.logits(x[(n - 1) * h..].to_vec(), 1)
            }
        })
    }

    fn decode(&self, states: &mut [&mut SequenceState], tokens: &[u32]) -> Result<Vec<f32>> {
        ensure!(
            states.len() == tokens.len(),
            "decode got {} sequences but {} tokens",
            states.len(),
            tokens.len()
        );
        self.check_tokens(tokens)?;
        let (m, c) = (&self.model, &self.model.config);
        let n = tokens.len();
        let hd = c.hidden_size;
        let mut x = self.embed(tokens);
        let mut margins = vec![f32::INFINITY; n];
        for (l, layer) in m.layers.iter().enumerate() {
            let h = self.norm(&x, &layer.input_norm);
            let mixed = match &layer.mixer {
                Mixer::Attention(w) => {
                    // Each sequence attends over its own cache at its own position.
                    let mut out = Vec::with_capacity(n * hd);
                    for (row, s) in states.iter_mut().enumerate() {
                        let position = s.position;
                        let LayerState::Attention { keys, values } = &mut s.layers[l] else {
                            anyhow::bail!("sequence state does not match layer {l} of the model");
                        };
                        out.extend(attention::forward(
                            c,
                            w,
                            &h[row * hd..(row + 1) * hd],
                            1,
                            position,
                            KvCache { keys, values },
                        ));
                    }
                    out
                }
                Mixer::DeltaNet(w) => {
                    let mut views = Vec::with_capacity(n);
                    for s in states.iter_mut() {
                        let LayerState::DeltaNet { conv, recurrent } = &mut s.layers[l] else {
                            anyhow::bail!("sequence state does not match layer {l} of the model");
                        };
                        views.push(DeltaNetState { conv, recurrent });
                    }
                    deltanet::decode(c, w, &h, &mut views)
                }
            };
            add_in_place(&mut x, &mixed);
            self.feed_forward(l, &mut x, n, &mut margins);
        }
        self.record_routing_margins(margins);
        for s in states.iter_mut() {
            s.position += 1;
        }
        Ok(self.logits(x, n))
    }
}

//! Per-sequence state: what a sequence carries from one step to the next.
//!
//! Attention layers keep a KV cache; Gated DeltaNet layers keep the last `kernel - 1` inputs of
//! their causal convolution and an fp32 recurrent state per value head. The state is plain data
//! and can be cloned (prefix caching and speculative decoding fork sequences this way).

use crate::config::{LayerKind, ModelConfig};

/// The state of one layer for one sequence.
#[derive(Clone, Debug)]
pub enum LayerState {
    Attention {
        /// `[positions, kv_heads, head_dim]`, RoPE already applied.
        keys: Vec<f32>,
        /// `[positions, kv_heads, head_dim]`.
        values: Vec<f32>,
    },
    DeltaNet {
        /// The previous `kernel - 1` convolution inputs, oldest first: `[kernel - 1, conv_dim]`.
        conv: Vec<f32>,
        /// `[value_heads, key_head_dim, value_head_dim]`.
        recurrent: Vec<f32>,
    },
}

/// The state of one sequence across all layers.
#[derive(Clone, Debug)]
pub struct SequenceState {
    /// Number of tokens processed so far (the position of the next token).
    pub position: usize,
    pub layers: Vec<LayerState>,
}

impl SequenceState {
    /// The state of a sequence that has seen no token.
    pub fn new(config: &ModelConfig) -> Self {
        let layers = config
            .layer_kinds
            .iter()
            .map(|kind| match kind {
                LayerKind::FullAttention => LayerState::Attention {
                    keys: Vec::new(),
                    values: Vec::new(),
                },
                LayerKind::LinearAttention => LayerState::DeltaNet {
                    conv: vec![0.0; (config.linear_conv_kernel_dim - 1) * config.linear_conv_dim()],
                    recurrent: vec![
                        0.0;
                        config.linear_num_value_heads
                            * config.linear_key_head_dim
                            * config.linear_value_head_dim
                    ],
                },
            })
            .collect();
        Self {
            position: 0,
            layers,
        }
    }
}

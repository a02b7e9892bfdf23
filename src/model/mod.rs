//! The model, described once for every backend: configuration, weights and per-sequence state.
//!
//! [`Model::load`] resolves every tensor of a checkpoint directory into typed per-layer weights,
//! whatever the layout on disk (multimodal `model.language_model.` prefix or not; experts packed
//! as `gate_up_proj`/`down_proj` or stored one tensor per expert). Matrices stay in the mapped
//! file in their stored dtype; small vectors (norms, gates) are converted to f32 once.

pub mod state;

use std::path::Path;

use anyhow::{Context, Result};

use crate::checkpoint::{Bytes, Checkpoint, DType, Tensor, convert_to_f32};
use crate::config::{LayerKind, ModelConfig};

/// A row-major `[rows, cols]` weight matrix in its stored dtype.
#[derive(Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub dtype: DType,
    pub bytes: Bytes,
}

impl Matrix {
    fn from_tensor(t: &Tensor, rows: usize, cols: usize) -> Result<Self> {
        t.expect_shape(&[rows, cols])?;
        Ok(Self {
            rows,
            cols,
            dtype: t.dtype,
            bytes: t.bytes.clone(),
        })
    }

    /// Rows `[start, start + count)` as a matrix of their own (no copy).
    fn row_block(&self, start: usize, count: usize) -> Matrix {
        let row = self.cols * self.dtype.size();
        Matrix {
            rows: count,
            cols: self.cols,
            dtype: self.dtype,
            bytes: self.bytes.slice(start * row, count * row),
        }
    }

    /// Writes rows `[start, start + out.len() / cols)` into `out` as f32.
    pub fn rows_to_f32(&self, start: usize, out: &mut [f32]) {
        let size = self.dtype.size();
        let begin = start * self.cols * size;
        let bytes = &self.bytes.as_slice()[begin..begin + out.len() * size];
        convert_to_f32(self.dtype, bytes, out);
    }
}

/// Gated full attention of one layer.
pub struct AttentionWeights {
    /// `[heads * 2 * head_dim, hidden]`: per head, the query then its output gate.
    pub q_proj: Matrix,
    pub k_proj: Matrix,
    pub v_proj: Matrix,
    pub o_proj: Matrix,
    /// Per-head RMSNorm scales, `1 + w` already applied.
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

/// Gated DeltaNet (linear attention) of one layer.
pub struct DeltaNetWeights {
    /// `[2 * key_dim + value_dim, hidden]`: queries, keys, values of all heads.
    pub in_proj_qkv: Matrix,
    pub in_proj_z: Matrix,
    pub in_proj_b: Matrix,
    pub in_proj_a: Matrix,
    pub out_proj: Matrix,
    /// Depthwise causal convolution, `[conv_dim, kernel]`.
    pub conv1d: Vec<f32>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// Gated RMSNorm scale over a value head (multiplied directly, no `1 +`).
    pub norm: Vec<f32>,
}

/// A SwiGLU feed-forward network: `down(silu(gate x) * up x)`.
pub struct FeedForward {
    pub gate: Matrix,
    pub up: Matrix,
    pub down: Matrix,
}

/// The sparse mixture of experts with its shared expert.
pub struct MoeWeights {
    /// Router, `[experts, hidden]`.
    pub router: Matrix,
    pub experts: Vec<FeedForward>,
    pub shared_expert: FeedForward,
    /// `[1, hidden]`: the shared expert's output is scaled by `sigmoid(gate · x)`.
    pub shared_expert_gate: Matrix,
}

/// The token mixer of a layer.
pub enum Mixer {
    Attention(AttentionWeights),
    DeltaNet(DeltaNetWeights),
}

pub struct LayerWeights {
    /// RMSNorm scales before the mixer and before the MoE, `1 + w` already applied.
    pub input_norm: Vec<f32>,
    pub mixer: Mixer,
    pub post_attention_norm: Vec<f32>,
    pub moe: MoeWeights,
}

/// A loaded model: its configuration and weights.
pub struct Model {
    pub config: ModelConfig,
    pub embed_tokens: Matrix,
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm scale, `1 + w` already applied.
    pub final_norm: Vec<f32>,
    pub lm_head: Matrix,
}

impl Model {
    /// Loads `config.json` and the safetensors weights of a checkpoint directory.
    pub fn load(dir: &Path) -> Result<Self> {
        let config = ModelConfig::from_model_dir(dir)?;
        let checkpoint = Checkpoint::open(dir)?;
        Self::from_checkpoint(config, &checkpoint)
            .with_context(|| format!("loading the checkpoint in {}", dir.display()))
    }

    /// Resolves every weight of `config` in `checkpoint`.
    pub fn from_checkpoint(config: ModelConfig, checkpoint: &Checkpoint) -> Result<Self> {
        let loader = Loader::new(&config, checkpoint)?;
        let h = config.hidden_size;
        let embed_tokens = loader.matrix("embed_tokens.weight", config.vocab_size, h)?;
        let lm_head = if config.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            Matrix::from_tensor(&checkpoint.tensor("lm_head.weight")?, config.vocab_size, h)?
        };
        let layers = (0..config.num_layers())
            .map(|i| loader.layer(i))
            .collect::<Result<Vec<_>>>()?;
        let final_norm = loader.rms_norm("norm.weight", h)?;
        Ok(Self {
            config,
            embed_tokens,
            layers,
            final_norm,
            lm_head,
        })
    }
}

/// Resolves tensor names under the checkpoint's prefix and checks their shapes.
struct Loader<'a> {
    config: &'a ModelConfig,
    checkpoint: &'a Checkpoint,
    prefix: &'static str,
}

impl<'a> Loader<'a> {
    fn new(config: &'a ModelConfig, checkpoint: &'a Checkpoint) -> Result<Self> {
        let prefix = ["model.language_model.", "model."]
            .into_iter()
            .find(|p| checkpoint.contains(&format!("{p}embed_tokens.weight")))
            .with_context(|| {
                format!(
                    "tensor `model.language_model.embed_tokens.weight` (or `model.embed_tokens.weight`) \
                     is missing from the checkpoint in {}",
                    checkpoint.dir().display()
                )
            })?;
        Ok(Self {
            config,
            checkpoint,
            prefix,
        })
    }

    fn tensor(&self, name: &str) -> Result<Tensor> {
        self.checkpoint.tensor(&format!("{}{name}", self.prefix))
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        Matrix::from_tensor(&self.tensor(name)?, rows, cols)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        t.expect_shape(&[len])?;
        Ok(t.to_f32_vec())
    }

    /// An RMSNorm weight `w`, returned as the scale `1 + w` the model multiplies by.
    fn rms_norm(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        Ok(self
            .vector(name, len)?
            .into_iter()
            .map(|w| 1.0 + w)
            .collect())
    }

    fn layer(&self, i: usize) -> Result<LayerWeights> {
        let c = self.config;
        let h = c.hidden_size;
        let p = format!("layers.{i}.");
        let mixer = match c.layer_kinds[i] {
            LayerKind::FullAttention => {
                let a = format!("{p}self_attn.");
                let (heads, kv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
                Mixer::Attention(AttentionWeights {
                    q_proj: self.matrix(&format!("{a}q_proj.weight"), heads * hd * 2, h)?,
                    k_proj: self.matrix(&format!("{a}k_proj.weight"), kv * hd, h)?,
                    v_proj: self.matrix(&format!("{a}v_proj.weight"), kv * hd, h)?,
                    o_proj: self.matrix(&format!("{a}o_proj.weight"), h, heads * hd)?,
                    q_norm: self.rms_norm(&format!("{a}q_norm.weight"), hd)?,
                    k_norm: self.rms_norm(&format!("{a}k_norm.weight"), hd)?,
                })
            }
            LayerKind::LinearAttention => {
                let l = format!("{p}linear_attn.");
                let (conv_dim, vd, hv) = (
                    c.linear_conv_dim(),
                    c.linear_value_dim(),
                    c.linear_num_value_heads,
                );
                let conv = self.tensor(&format!("{l}conv1d.weight"))?;
                conv.expect_shape(&[conv_dim, 1, c.linear_conv_kernel_dim])?;
                Mixer::DeltaNet(DeltaNetWeights {
                    in_proj_qkv: self.matrix(&format!("{l}in_proj_qkv.weight"), conv_dim, h)?,
                    in_proj_z: self.matrix(&format!("{l}in_proj_z.weight"), vd, h)?,
                    in_proj_b: self.matrix(&format!("{l}in_proj_b.weight"), hv, h)?,
                    in_proj_a: self.matrix(&format!("{l}in_proj_a.weight"), hv, h)?,
                    out_proj: self.matrix(&format!("{l}out_proj.weight"), h, vd)?,
                    conv1d: conv.to_f32_vec(),
                    a_log: self.vector(&format!("{l}A_log"), hv)?,
                    dt_bias: self.vector(&format!("{l}dt_bias"), hv)?,
                    norm: self.vector(&format!("{l}norm.weight"), c.linear_value_head_dim)?,
                })
            }
        };
        Ok(LayerWeights {
            input_norm: self.rms_norm(&format!("{p}input_layernorm.weight"), h)?,
            mixer,
            post_attention_norm: self
                .rms_norm(&format!("{p}post_attention_layernorm.weight"), h)?,
            moe: self.moe(&format!("{p}mlp."))?,
        })
    }

    fn moe(&self, m: &str) -> Result<MoeWeights> {
        let c = self.config;
        let (h, e, inter, shared) = (
            c.hidden_size,
            c.num_experts,
            c.moe_intermediate_size,
            c.shared_expert_intermediate_size,
        );
        let packed = format!("{}{m}experts.gate_up_proj", self.prefix);
        let experts = if self.checkpoint.contains(&packed) {
            // Packed: gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I].
            let gate_up = self.tensor(&format!("{m}experts.gate_up_proj"))?;
            gate_up.expect_shape(&[e, 2 * inter, h])?;
            let down = self.tensor(&format!("{m}experts.down_proj"))?;
            down.expect_shape(&[e, h, inter])?;
            let gate_up = Matrix::from_tensor(&flatten(gate_up), e * 2 * inter, h)?;
            let down = Matrix::from_tensor(&flatten(down), e * h, inter)?;
            (0..e)
                .map(|x| FeedForward {
                    gate: gate_up.row_block(x * 2 * inter, inter),
                    up: gate_up.row_block(x * 2 * inter + inter, inter),
                    down: down.row_block(x * h, h),
                })
                .collect()
        } else {
            (0..e)
                .map(|x| self.feed_forward(&format!("{m}experts.{x}."), inter))
                .collect::<Result<Vec<_>>>()?
        };
        Ok(MoeWeights {
            router: self.matrix(&format!("{m}gate.weight"), e, h)?,
            experts,
            shared_expert: self.feed_forward(&format!("{m}shared_expert."), shared)?,
            shared_expert_gate: self.matrix(&format!("{m}shared_expert_gate.weight"), 1, h)?,
        })
    }

    fn feed_forward(&self, p: &str, inter: usize) -> Result<FeedForward> {
        let h = self.config.hidden_size;
        Ok(FeedForward {
            gate: self.matrix(&format!("{p}gate_proj.weight"), inter, h)?,
            up: self.matrix(&format!("{p}up_proj.weight"), inter, h)?,
            down: self.matrix(&format!("{p}down_proj.weight"), h, inter)?,
        })
    }
}

/// Views a 3-D tensor `[a, b, c]` as `[a * b, c]` (same bytes).
fn flatten(mut t: Tensor) -> Tensor {
    if let [a, b, c] = t.shape[..] {
        t.shape = vec![a * b, c];
    }
    t
}

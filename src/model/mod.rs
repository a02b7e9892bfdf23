//! The model, described once for every backend: configuration, weights and per-sequence state.
//!
//! [`Model::load`] resolves every tensor of a checkpoint directory into typed per-layer weights,
//! whatever the layout on disk: Hugging Face exports (multimodal `model.language_model.` prefix or
//! not; experts packed as `gate_up_proj`/`down_proj` or stored one tensor per expert) or MLX-LM
//! checkpoints (`language_model.model.` prefix, stacked `switch_mlp` experts, matrices dense or
//! affine-quantised as `config.json`'s `quantization` block says). Matrices stay in the mapped
//! file as stored; small vectors (norms, gates) are converted to f32 once.

pub mod demo;
pub mod state;

use std::path::Path;

use anyhow::{Context, Result, bail, ensure};

use crate::checkpoint::{Bytes, Checkpoint, DType, Tensor, convert_to_f32};
use crate::config::{LayerKind, ModelConfig};
use crate::quant::{QuantSpec, dequantize_row};

/// A row-major `[rows, cols]` weight matrix, left in the mapped file as stored.
#[derive(Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub storage: Storage,
}

/// How a [`Matrix`]'s elements are stored.
#[derive(Clone)]
pub enum Storage {
    /// `rows * cols` elements of `dtype`.
    Dense { dtype: DType, bytes: Bytes },
    /// MLX affine quantisation (see [`crate::quant`]).
    Quantized(QuantizedStorage),
}

/// An MLX affine-quantised matrix: per row, `spec.words_per_row(cols)` little-endian uint32
/// words and `spec.groups_per_row(cols)` scales and biases of `scale_dtype`.
#[derive(Clone)]
pub struct QuantizedStorage {
    pub spec: QuantSpec,
    pub words: Bytes,
    pub scale_dtype: DType,
    pub scales: Bytes,
    pub biases: Bytes,
}

impl Matrix {
    /// Views a float tensor of exactly `[rows, cols]` as a dense matrix.
    pub fn dense(t: &Tensor, rows: usize, cols: usize) -> Result<Self> {
        t.expect_shape(&[rows, cols])?;
        Ok(Self {
            rows,
            cols,
            storage: Storage::Dense {
                dtype: t.dtype,
                bytes: t.bytes.clone(),
            },
        })
    }

    /// Rows `[start, start + count)` as a matrix of their own (no copy).
    pub fn row_block(&self, start: usize, count: usize) -> Matrix {
        let storage = match &self.storage {
            Storage::Dense { dtype, bytes } => {
                let row = self.cols * dtype.size();
                Storage::Dense {
                    dtype: *dtype,
                    bytes: bytes.slice(start * row, count * row),
                }
            }
            Storage::Quantized(q) => {
                let word_row = q.spec.words_per_row(self.cols) * 4;
                let group_row = q.spec.groups_per_row(self.cols) * q.scale_dtype.size();
                Storage::Quantized(QuantizedStorage {
                    spec: q.spec,
                    words: q.words.slice(start * word_row, count * word_row),
                    scale_dtype: q.scale_dtype,
                    scales: q.scales.slice(start * group_row, count * group_row),
                    biases: q.biases.slice(start * group_row, count * group_row),
                })
            }
        };
        Matrix {
            rows: count,
            cols: self.cols,
            storage,
        }
    }

    /// Bytes the matrix occupies in its file.
    pub fn stored_bytes(&self) -> usize {
        match &self.storage {
            Storage::Dense { bytes, .. } => bytes.as_slice().len(),
            Storage::Quantized(q) => [&q.words, &q.scales, &q.biases]
                .iter()
                .map(|b| b.as_slice().len())
                .sum(),
        }
    }

    /// Reads one byte of every memory page of the matrix, so the pages are resident.
    pub fn page_in(&self) -> usize {
        let mut sum = 0u8;
        let mut touch = |bytes: &Bytes| {
            for byte in bytes.as_slice().iter().step_by(PAGE_BYTES) {
                sum = sum.wrapping_add(*byte);
            }
        };
        match &self.storage {
            Storage::Dense { bytes, .. } => touch(bytes),
            Storage::Quantized(q) => [&q.words, &q.scales, &q.biases].into_iter().for_each(touch),
        }
        std::hint::black_box(sum);
        self.stored_bytes()
    }

    /// Lets the kernel drop the matrix's pages from the resident set (see
    /// [`Bytes::release_resident`]).
    pub fn release_resident(&self) {
        match &self.storage {
            Storage::Dense { bytes, .. } => bytes.release_resident(),
            Storage::Quantized(q) => {
                q.words.release_resident();
                q.scales.release_resident();
                q.biases.release_resident();
            }
        }
    }

    /// Writes rows `[start, start + out.len() / cols)` into `out` as f32, dequantising them if
    /// they are quantised.
    pub fn rows_to_f32(&self, start: usize, out: &mut [f32]) {
        let cols = self.cols;
        match &self.storage {
            Storage::Dense { dtype, bytes } => {
                let size = dtype.size();
                let begin = start * cols * size;
                let bytes = &bytes.as_slice()[begin..begin + out.len() * size];
                convert_to_f32(*dtype, bytes, out);
            }
            Storage::Quantized(q) => {
                let word_row = q.spec.words_per_row(cols) * 4;
                let groups = q.spec.groups_per_row(cols);
                let group_row = groups * q.scale_dtype.size();
                let (words, scales, biases) =
                    (q.words.as_slice(), q.scales.as_slice(), q.biases.as_slice());
                let mut row_scales = vec![0.0f32; groups];
                let mut row_biases = vec![0.0f32; groups];
                for (i, out_row) in out.chunks_exact_mut(cols).enumerate() {
                    let r = start + i;
                    let group_bytes = r * group_row..(r + 1) * group_row;
                    convert_to_f32(q.scale_dtype, &scales[group_bytes.clone()], &mut row_scales);
                    convert_to_f32(q.scale_dtype, &biases[group_bytes], &mut row_biases);
                    dequantize_row(
                        q.spec,
                        &words[r * word_row..(r + 1) * word_row],
                        &row_scales,
                        &row_biases,
                        out_row,
                    );
                }
            }
        }
    }
}

/// The smallest memory page size of the platforms lily runs on.
const PAGE_BYTES: usize = 4096;

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
    /// Every weight matrix: embedding, each layer's projections, routers and experts, lm_head.
    pub fn matrices(&self) -> Vec<&Matrix> {
        let mut all = vec![&self.embed_tokens];
        if !self.config.tie_word_embeddings {
            all.push(&self.lm_head);
        }
        for layer in &self.layers {
            match &layer.mixer {
                Mixer::Attention(a) => all.extend([&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj]),
                Mixer::DeltaNet(d) => all.extend([
                    &d.in_proj_qkv,
                    &d.in_proj_z,
                    &d.in_proj_b,
                    &d.in_proj_a,
                    &d.out_proj,
                ]),
            }
            let moe = &layer.moe;
            all.extend([&moe.router, &moe.shared_expert_gate]);
            for ffn in moe.experts.iter().chain([&moe.shared_expert]) {
                all.extend([&ffn.gate, &ffn.up, &ffn.down]);
            }
        }
        all
    }

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
        let embed_tokens = loader.matrix("embed_tokens", config.vocab_size, h)?;
        let lm_head = if config.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            let path = loader.layout.lm_head_path();
            loader.weight(path, &[config.vocab_size, h])?
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

/// The naming and storage conventions of a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Hugging Face exports (multimodal `model.language_model.` or text-only `model.` prefix):
    /// RMSNorm weights `w` stored as such (scale `1 + w`), conv1d `[channels, 1, kernel]`, experts
    /// packed (`experts.gate_up_proj`/`experts.down_proj`) or one tensor per expert.
    HuggingFace { prefix: &'static str },
    /// What MLX-LM writes (`language_model.model.` prefix): its `sanitize` folded the `+1` into the
    /// RMSNorm weights and moved conv1d to `[channels, kernel, 1]`; experts are stacked as
    /// `switch_mlp.{gate,up,down}_proj`; any matrix may be quantised.
    Mlx,
}

impl Layout {
    pub const MLX_PREFIX: &'static str = "language_model.model.";

    /// Recognises the layout from the name of the embedding tensor.
    pub fn detect(checkpoint: &Checkpoint) -> Result<Self> {
        let has_embedding = |p: &str| checkpoint.contains(&format!("{p}embed_tokens.weight"));
        if has_embedding(Self::MLX_PREFIX) {
            return Ok(Layout::Mlx);
        }
        ["model.language_model.", "model."]
            .into_iter()
            .find(|p| has_embedding(p))
            .map(|prefix| Layout::HuggingFace { prefix })
            .with_context(|| {
                format!(
                    "tensor `model.language_model.embed_tokens.weight` (or `model.embed_tokens.weight`, \
                     or MLX-LM's `language_model.model.embed_tokens.weight`) is missing from the \
                     checkpoint in {}",
                    checkpoint.dir().display()
                )
            })
    }

    /// The prefix of the text model's tensors (all but lm_head).
    pub fn prefix(self) -> &'static str {
        match self {
            Layout::HuggingFace { prefix } => prefix,
            Layout::Mlx => Self::MLX_PREFIX,
        }
    }

    /// The module path of lm_head.
    pub fn lm_head_path(self) -> &'static str {
        match self {
            Layout::HuggingFace { .. } => "lm_head",
            Layout::Mlx => "language_model.lm_head",
        }
    }
}

/// Resolves tensor names under the checkpoint's layout and checks their shapes.
struct Loader<'a> {
    config: &'a ModelConfig,
    checkpoint: &'a Checkpoint,
    layout: Layout,
}

impl<'a> Loader<'a> {
    fn new(config: &'a ModelConfig, checkpoint: &'a Checkpoint) -> Result<Self> {
        Ok(Self {
            config,
            checkpoint,
            layout: Layout::detect(checkpoint)?,
        })
    }

    fn tensor(&self, name: &str) -> Result<Tensor> {
        self.checkpoint
            .tensor(&format!("{}{name}", self.layout.prefix()))
    }

    /// The weight of the linear module `module` (under the prefix), logically `[rows, cols]`.
    fn matrix(&self, module: &str, rows: usize, cols: usize) -> Result<Matrix> {
        self.weight(&format!("{}{module}", self.layout.prefix()), &[rows, cols])
    }

    /// The weight of the module at the full path `path`, of logical shape `shape` (its last axis
    /// is the input; the others are flattened into rows): dense `{path}.weight`, or quantised
    /// `{path}.weight` (packed words), `{path}.scales` and `{path}.biases`.
    fn weight(&self, path: &str, shape: &[usize]) -> Result<Matrix> {
        let Some((&cols, outer)) = shape.split_last() else {
            bail!("weight `{path}` needs at least one axis");
        };
        let rows = outer.iter().product();
        let weight_name = format!("{path}.weight");
        let Some(spec) = self.quant_spec(path, cols)? else {
            ensure!(
                self.checkpoint.packed_tensor(&weight_name).is_err(),
                "tensor `{weight_name}` holds packed quantised values but `{path}.scales` is \
                 missing from the checkpoint"
            );
            let t = self.checkpoint.tensor(&weight_name)?;
            t.expect_shape(shape)?;
            return Matrix::dense(&t.reshaped(rows, cols), rows, cols);
        };
        let with_last = |last: usize| [outer, &[last]].concat();
        let words = self.checkpoint.packed_tensor(&weight_name)?;
        words.expect_shape(&with_last(spec.words_per_row(cols)))?;
        let groups = with_last(spec.groups_per_row(cols));
        let scales = self.checkpoint.tensor(&format!("{path}.scales"))?;
        scales.expect_shape(&groups)?;
        let biases = self.checkpoint.tensor(&format!("{path}.biases"))?;
        biases.expect_shape(&groups)?;
        ensure!(
            biases.dtype == scales.dtype,
            "tensor `{}` in {} is {} but its scales are {}",
            biases.name,
            biases.file.display(),
            biases.dtype,
            scales.dtype
        );
        Ok(Matrix {
            rows,
            cols,
            storage: Storage::Quantized(QuantizedStorage {
                spec,
                words: words.bytes,
                scale_dtype: scales.dtype,
                scales: scales.bytes,
                biases: biases.bytes,
            }),
        })
    }

    /// How the module at `path` (rows of `cols` inputs) is quantised, if it is: as `config.json`
    /// says for that path, or else (as MLX-LM does) as the shapes of its tensors say.
    fn quant_spec(&self, path: &str, cols: usize) -> Result<Option<QuantSpec>> {
        let scales_name = format!("{path}.scales");
        let has_scales = self.checkpoint.contains(&scales_name);
        let Some(quantization) = &self.config.quantization else {
            ensure!(
                !has_scales,
                "tensor `{scales_name}` marks `{path}` as quantised, but config.json has no \
                 `quantization` block"
            );
            return Ok(None);
        };
        match quantization.override_for(path) {
            Some(Some(spec)) => {
                ensure!(
                    has_scales,
                    "config.json quantises `{path}` ({}-bit, group size {}) but tensor \
                     `{scales_name}` is missing from the checkpoint",
                    spec.bits,
                    spec.group_size
                );
                ensure!(
                    spec.fits(cols),
                    "config.json quantises `{path}` with group size {}, which does not divide \
                     its {cols} inputs",
                    spec.group_size
                );
                Ok(Some(spec))
            }
            Some(None) => {
                ensure!(
                    !has_scales,
                    "config.json leaves `{path}` unquantised but tensor `{scales_name}` exists"
                );
                Ok(None)
            }
            None if has_scales => self.inferred_spec(path, cols).map(Some),
            None => Ok(None),
        }
    }

    /// The bits and group size that the shapes of `{path}.weight` and `{path}.scales` imply.
    fn inferred_spec(&self, path: &str, cols: usize) -> Result<QuantSpec> {
        let words = self.checkpoint.packed_tensor(&format!("{path}.weight"))?;
        let scales = self.checkpoint.tensor(&format!("{path}.scales"))?;
        let words_per_row = words.shape.last().copied().unwrap_or(0);
        let groups_per_row = scales.shape.last().copied().unwrap_or(0);
        let bits = (words_per_row * 32).checked_div(cols).unwrap_or(0);
        let group_size = cols.checked_div(groups_per_row).unwrap_or(0);
        ensure!(
            bits * cols == words_per_row * 32 && group_size * groups_per_row == cols,
            "tensors `{path}.weight` {:?} and `{path}.scales` {:?} in {} do not pack rows of {cols} \
             values",
            words.shape,
            scales.shape,
            words.file.display()
        );
        QuantSpec::new(bits as u32, group_size).with_context(|| {
            format!(
                "tensor `{path}.weight` in {} ({bits}-bit, group size {group_size}, as its shape \
                 and its scales' say)",
                words.file.display()
            )
        })
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        t.expect_shape(&[len])?;
        Ok(t.to_f32_vec())
    }

    /// An RMSNorm weight, returned as the scale the model multiplies by: `1 + w` for the weight
    /// `w` Hugging Face stores, the stored value itself where MLX-LM folded the `+1` in.
    fn rms_norm(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let stored = self.vector(name, len)?;
        Ok(match self.layout {
            Layout::HuggingFace { .. } => stored.into_iter().map(|w| 1.0 + w).collect(),
            Layout::Mlx => stored,
        })
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
                    q_proj: self.matrix(&format!("{a}q_proj"), heads * hd * 2, h)?,
                    k_proj: self.matrix(&format!("{a}k_proj"), kv * hd, h)?,
                    v_proj: self.matrix(&format!("{a}v_proj"), kv * hd, h)?,
                    o_proj: self.matrix(&format!("{a}o_proj"), h, heads * hd)?,
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
                // Either way the taps of a channel are contiguous: the two shapes share one order.
                let kernel = c.linear_conv_kernel_dim;
                conv.expect_shape(&match self.layout {
                    Layout::HuggingFace { .. } => [conv_dim, 1, kernel],
                    Layout::Mlx => [conv_dim, kernel, 1],
                })?;
                Mixer::DeltaNet(DeltaNetWeights {
                    in_proj_qkv: self.matrix(&format!("{l}in_proj_qkv"), conv_dim, h)?,
                    in_proj_z: self.matrix(&format!("{l}in_proj_z"), vd, h)?,
                    in_proj_b: self.matrix(&format!("{l}in_proj_b"), hv, h)?,
                    in_proj_a: self.matrix(&format!("{l}in_proj_a"), hv, h)?,
                    out_proj: self.matrix(&format!("{l}out_proj"), h, vd)?,
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
        let prefix = self.layout.prefix();
        let experts = if self.layout == Layout::Mlx {
            // Stacked: gate and up [E, I, H], down [E, H, I], each dense or quantised.
            let stacked = |name: &str, rows: usize, cols: usize| {
                self.weight(&format!("{prefix}{m}switch_mlp.{name}"), &[e, rows, cols])
            };
            let gate = stacked("gate_proj", inter, h)?;
            let up = stacked("up_proj", inter, h)?;
            let down = stacked("down_proj", h, inter)?;
            (0..e)
                .map(|x| FeedForward {
                    gate: gate.row_block(x * inter, inter),
                    up: up.row_block(x * inter, inter),
                    down: down.row_block(x * h, h),
                })
                .collect()
        } else if self
            .checkpoint
            .contains(&format!("{prefix}{m}experts.gate_up_proj"))
        {
            // Packed: gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I].
            let gate_up = self.tensor(&format!("{m}experts.gate_up_proj"))?;
            gate_up.expect_shape(&[e, 2 * inter, h])?;
            let down = self.tensor(&format!("{m}experts.down_proj"))?;
            down.expect_shape(&[e, h, inter])?;
            let gate_up = Matrix::dense(&gate_up.reshaped(e * 2 * inter, h), e * 2 * inter, h)?;
            let down = Matrix::dense(&down.reshaped(e * h, inter), e * h, inter)?;
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
            router: self.matrix(&format!("{m}gate"), e, h)?,
            experts,
            shared_expert: self.feed_forward(&format!("{m}shared_expert."), shared)?,
            shared_expert_gate: self.matrix(&format!("{m}shared_expert_gate"), 1, h)?,
        })
    }

    fn feed_forward(&self, p: &str, inter: usize) -> Result<FeedForward> {
        let h = self.config.hidden_size;
        Ok(FeedForward {
            gate: self.matrix(&format!("{p}gate_proj"), inter, h)?,
            up: self.matrix(&format!("{p}up_proj"), inter, h)?,
            down: self.matrix(&format!("{p}down_proj"), h, inter)?,
        })
    }
}

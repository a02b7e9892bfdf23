//! The model's weights in device memory, laid out for the decode kernels.
//!
//! Matrices that read the same input are concatenated by rows at upload so one launch computes
//! them all: the DeltaNet input projections (qkv | z | b | a), the attention projections
//! (q+gate | k | v) and the router with the shared-expert gate. Routed experts are stacked:
//! gate and up `[experts * intermediate, hidden]`, down `[experts * hidden, intermediate]`.
//! Dense weights are stored as bf16, quantised ones in MLX's affine format with 16-bit scales and
//! biases (bf16, or fp16 for checkpoints that store them so: [`ScaleFormat`]); small vectors
//! (norm scales, conv taps, gates) as f32.

use std::sync::Arc;

use anyhow::{Result, ensure};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, PushKernelArg};
use rayon::prelude::*;

use super::cfg;
use super::shapes::FOLD_TILE;

use crate::checkpoint::{DType, convert_to_f32};
use crate::config::ModelConfig;
use crate::model::{FeedForward, Matrix, Mixer, Model, MoeWeights, QuantizedStorage, Storage};

/// The 16-bit format of quantised weights' scales and biases on the device. The kernels read one
/// format, fixed when they are compiled (`LILY_SCALES_F16`), so one model uses one for all its
/// weights: the one that holds the checkpoint's values exactly, or nearest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleFormat {
    Bf16,
    F16,
}

impl ScaleFormat {
    /// The format for `model`'s quantised matrices: their own when all store bf16 (as MLX-LM
    /// writes bf16 models) or all fp16; otherwise (f32, or mixed) the one whose largest
    /// relative rounding error over every scale and bias is smaller.
    pub fn for_model(model: &Model) -> Self {
        let stored: Vec<(DType, [&[u8]; 2])> = model
            .matrices()
            .into_iter()
            .filter_map(|m| match &m.storage {
                Storage::Quantized(q) => {
                    Some((q.scale_dtype, [q.scales.as_slice(), q.biases.as_slice()]))
                }
                Storage::Dense { .. } => None,
            })
            .collect();
        Self::for_stored(&stored)
    }

    /// The format for quantised matrices whose scales and biases are stored as `stored`: per
    /// matrix, their dtype and their bytes.
    fn for_stored(stored: &[(DType, [&[u8]; 2])]) -> Self {
        if stored.iter().all(|(dtype, _)| *dtype == DType::BF16) {
            return Self::Bf16;
        }
        if stored.iter().all(|(dtype, _)| *dtype == DType::F16) {
            return Self::F16;
        }
        let (mut bf16_worst, mut f16_worst) = (0.0f32, 0.0f32);
        let mut values = Vec::new();
        for (dtype, parts) in stored {
            for bytes in parts {
                values.resize(bytes.len() / dtype.size(), 0.0);
                convert_to_f32(*dtype, bytes, &mut values);
                bf16_worst = bf16_worst.max(Self::Bf16.worst_rounding(&values));
                f16_worst = f16_worst.max(Self::F16.worst_rounding(&values));
            }
        }
        if f16_worst < bf16_worst {
            Self::F16
        } else {
            Self::Bf16
        }
    }

    /// The define the kernels are compiled with for this format.
    pub fn define(self) -> Option<&'static str> {
        match self {
            Self::Bf16 => None,
            Self::F16 => Some("LILY_SCALES_F16"),
        }
    }

    fn bits(self, v: f32) -> u16 {
        match self {
            Self::Bf16 => half::bf16::from_f32(v).to_bits(),
            Self::F16 => half::f16::from_f32(v).to_bits(),
        }
    }

    fn value(self, bits: u16) -> f32 {
        match self {
            Self::Bf16 => half::bf16::from_bits(bits).to_f32(),
            Self::F16 => half::f16::from_bits(bits).to_f32(),
        }
    }

    /// The largest |rounded - v| / |v| over `values` (infinite where the format overflows).
    fn worst_rounding(self, values: &[f32]) -> f32 {
        values
            .iter()
            .filter(|v| **v != 0.0)
            .map(|&v| ((self.value(self.bits(v)) - v) / v).abs())
            .fold(
                0.0,
                |a, e| if e.is_nan() { f32::INFINITY } else { a.max(e) },
            )
    }

    /// `bytes` (values of `dtype`) in this format, appended to `out`: copied when `dtype` is
    /// this format, else rounded to nearest.
    fn encode(self, dtype: DType, bytes: &[u8], out: &mut Vec<u16>) {
        let same = matches!(
            (self, dtype),
            (Self::Bf16, DType::BF16) | (Self::F16, DType::F16)
        );
        if same {
            out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]])),
            );
            return;
        }
        let mut f = vec![0.0f32; bytes.len() / dtype.size()];
        convert_to_f32(dtype, bytes, &mut f);
        out.extend(f.iter().map(|v| self.bits(*v)));
    }
}

/// A weight matrix on the device (see `struct Weight` in kernels/common.cuh).
pub struct DeviceWeight {
    data: CudaSlice<u8>,
    scales: Option<CudaSlice<u16>>,
    biases: Option<CudaSlice<u16>>,
    pub rows: usize,
    pub cols: usize,
    /// 16 for dense bf16, else the MLX quantisation width.
    pub bits: usize,
    pub group: usize,
    /// Dense: every value is within fp16's range (the prefill's tensor-core products convert
    /// bf16 weights to fp16; a matrix with a larger value stays on the mat-vec kernels).
    pub fits_fp16: bool,
}

/// Whether the bf16 value with these bits is finite and at most fp16's largest (65504: bf16's
/// largest below it is 65280, 0x477F).
fn bf16_fits_fp16(bits: u16) -> bool {
    bits & 0x7FFF <= 0x477F
}

/// The kernel-side descriptor of a [`DeviceWeight`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct WeightDesc {
    data: u64,
    scales: u64,
    biases: u64,
    rows: i32,
    cols: i32,
    bits: i32,
    group_shift: i32,
}

// SAFETY: plain old data with the layout of `struct Weight` in common.cuh.
unsafe impl DeviceRepr for WeightDesc {}

/// A layer's router folded through its mixer's output projection (see `out_proj_route` in
/// moe.cu): `[experts + 1, mixer output width + hidden]` in fp16, each row times its
/// power-of-two scale.
pub struct RouterFold {
    data: CudaSlice<u8>,
    row_scale: CudaSlice<f32>,
    pub rows: usize,
    pub cols: usize,
}

/// The kernel-side descriptor of a [`RouterFold`] (`struct Fold` in moe.cu).
/// The default, all zeros, is no fold (the router's own rows).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FoldDesc {
    data: u64,
    row_scale: u64,
    rows: i32,
    cols: i32,
}

// SAFETY: plain old data with the layout of `struct Fold` in moe.cu.
unsafe impl DeviceRepr for FoldDesc {}

impl RouterFold {
    pub fn desc(&self, stream: &CudaStream) -> FoldDesc {
        FoldDesc {
            data: ptr(&self.data, stream),
            row_scale: ptr(&self.row_scale, stream),
            rows: self.rows as i32,
            cols: self.cols as i32,
        }
    }

    /// Device memory the fold occupies, in bytes.
    pub fn bytes(&self) -> usize {
        self.data.len() + self.row_scale.num_bytes()
    }
}

pub fn ptr<T>(slice: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    slice.device_ptr(stream).0
}

impl DeviceWeight {
    /// Uploads the row-concatenation of `parts` as one device matrix. Quantised parts that share
    /// one setting stay in MLX's format (scales and biases in `scales`); dense parts, or parts
    /// quantised differently from each other, are stored as bf16.
    pub fn upload(
        stream: &Arc<CudaStream>,
        scales: ScaleFormat,
        parts: &[&Matrix],
    ) -> Result<Self> {
        let cols = parts[0].cols;
        ensure!(
            parts.iter().all(|m| m.cols == cols),
            "fused matrices differ in width"
        );
        let rows: usize = parts.iter().map(|m| m.rows).sum();
        if let WeightFormat::Affine { .. } = upload_format(parts) {
            let qs: Vec<&QuantizedStorage> = parts
                .iter()
                .filter_map(|m| match &m.storage {
                    Storage::Quantized(q) => Some(q),
                    Storage::Dense { .. } => None,
                })
                .collect();
            return Self::upload_quantized(stream, scales, &qs, rows, cols);
        }
        ensure!(
            cols.is_multiple_of(8),
            "matrix width {cols} is not a multiple of 8 (16-byte rows)"
        );
        let mut host = Vec::with_capacity(rows * cols * 2);
        let mut row = vec![0.0f32; cols];
        for m in parts {
            if let Storage::Dense {
                dtype: DType::BF16,
                bytes,
            } = &m.storage
            {
                host.extend_from_slice(bytes.as_slice());
                continue;
            }
            for r in 0..m.rows {
                m.rows_to_f32(r, &mut row);
                for v in &row {
                    host.extend_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
                }
            }
        }
        let fits_fp16 = host.par_chunks(1 << 20).all(|c| {
            c.chunks_exact(2)
                .all(|b| bf16_fits_fp16(u16::from_le_bytes([b[0], b[1]])))
        });
        Ok(Self::bf16(stream.clone_htod(&host)?, rows, cols, fits_fp16))
    }

    /// A dense bf16 matrix already on the device.
    fn bf16(data: CudaSlice<u8>, rows: usize, cols: usize, fits_fp16: bool) -> Self {
        Self {
            data,
            scales: None,
            biases: None,
            rows,
            cols,
            bits: 16,
            group: 0,
            fits_fp16,
        }
    }

    fn upload_quantized(
        stream: &Arc<CudaStream>,
        format: ScaleFormat,
        parts: &[&QuantizedStorage],
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        let spec = parts[0].spec;
        // The kernels read 16-byte chunks that must not straddle a group, and find a value's
        // group with a shift.
        ensure!(
            (spec.bits == 4 || spec.bits == 8)
                && spec.group_size >= 128 / spec.bits as usize
                && spec.group_size.is_power_of_two(),
            "{}-bit quantisation with group size {} is not supported on the GPU",
            spec.bits,
            spec.group_size
        );
        let mut words = Vec::with_capacity(rows * cols * spec.bits as usize / 8);
        let mut scales = Vec::new();
        let mut biases = Vec::new();
        for q in parts {
            words.extend_from_slice(q.words.as_slice());
            format.encode(q.scale_dtype, q.scales.as_slice(), &mut scales);
            format.encode(q.scale_dtype, q.biases.as_slice(), &mut biases);
        }
        Ok(Self {
            data: stream.clone_htod(&words)?,
            scales: Some(stream.clone_htod(&scales)?),
            biases: Some(stream.clone_htod(&biases)?),
            rows,
            cols,
            bits: spec.bits as usize,
            group: spec.group_size,
            fits_fp16: false,
        })
    }

    /// Device memory the weight occupies, in bytes.
    pub fn bytes(&self) -> usize {
        // Scales and biases: 16 bits each per group.
        self.data.len() + 2 * 2 * self.scales.as_ref().map_or(0, |s| s.len())
    }

    /// How the matrix is stored.
    pub fn format(&self) -> WeightFormat {
        match self.bits {
            16 => WeightFormat::Bf16,
            bits => WeightFormat::Affine {
                bits,
                group: self.group,
            },
        }
    }

    pub fn desc(&self, stream: &CudaStream) -> WeightDesc {
        WeightDesc {
            data: ptr(&self.data, stream),
            scales: self.scales.as_ref().map_or(0, |s| ptr(s, stream)),
            biases: self.biases.as_ref().map_or(0, |s| ptr(s, stream)),
            rows: self.rows as i32,
            cols: self.cols as i32,
            bits: self.bits as i32,
            // Quantised groups are powers of two (checked at upload); bf16 has none.
            group_shift: if self.bits == 16 {
                0
            } else {
                self.group.trailing_zeros() as i32
            },
        }
    }

    /// A weight filled with pseudo-random values on the device (synthetic benchmarks).
    pub fn random(
        stream: &Arc<CudaStream>,
        fill: &super::Fill,
        rows: usize,
        cols: usize,
        format: WeightFormat,
        seed: u64,
    ) -> Result<Self> {
        let scale = 1.0 / (cols as f32).sqrt();
        match format {
            WeightFormat::Bf16 => {
                let data = stream.alloc_zeros::<u8>(rows * cols * 2)?;
                fill.bf16(stream, ptr(&data, stream), rows * cols, seed, scale)?;
                // Uniform in [-scale, scale), scale at most 1.
                Ok(Self::bf16(data, rows, cols, true))
            }
            WeightFormat::Affine { bits, group } => {
                let words = rows * cols * bits / 32;
                let data = stream.alloc_zeros::<u8>(words * 4)?;
                fill.u32(stream, ptr(&data, stream), words, seed)?;
                let groups = rows * cols / group;
                let scales = stream.alloc_zeros::<u16>(groups)?;
                let biases = stream.alloc_zeros::<u16>(groups)?;
                let qmax = ((1u32 << bits) - 1) as f32;
                fill.bf16(
                    stream,
                    ptr(&scales, stream),
                    groups,
                    seed ^ 1,
                    2.0 * scale / qmax,
                )?;
                fill.bf16(stream, ptr(&biases, stream), groups, seed ^ 2, scale)?;
                Ok(Self {
                    data,
                    scales: Some(scales),
                    biases: Some(biases),
                    rows,
                    cols,
                    bits,
                    group,
                    fits_fp16: false,
                })
            }
        }
    }
}

/// How a matrix is stored on the device (and how synthetic weights are made).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    Bf16,
    Affine { bits: usize, group: usize },
}

/// The format [`DeviceWeight::upload`] stores the row-concatenation of `parts` in: MLX's
/// quantisation where every part is quantised alike, else bf16.
pub fn upload_format(parts: &[&Matrix]) -> WeightFormat {
    let spec = |m: &Matrix| match &m.storage {
        Storage::Quantized(q) => Some(q.spec),
        Storage::Dense { .. } => None,
    };
    match spec(parts[0]) {
        Some(first) if parts.iter().all(|m| spec(m) == Some(first)) => WeightFormat::Affine {
            bits: first.bits as usize,
            group: first.group_size,
        },
        _ => WeightFormat::Bf16,
    }
}

/// The format all of `formats` share, if they share one.
fn common_format(formats: impl IntoIterator<Item = WeightFormat>) -> Option<WeightFormat> {
    let mut formats = formats.into_iter();
    let first = formats.next()?;
    formats.all(|f| f == first).then_some(first)
}

pub enum DeviceMixer {
    DeltaNet {
        /// Rows: qkv (conv_dim) | z (value_dim) | b (value heads) | a (value heads).
        in_proj: DeviceWeight,
        out_proj: DeviceWeight,
        conv_w: CudaSlice<f32>,
        a_log: CudaSlice<f32>,
        dt_bias: CudaSlice<f32>,
        norm: CudaSlice<f32>,
    },
    Attention {
        /// Rows: q+gate (heads * 2 * head_dim) | k | v.
        qkv: DeviceWeight,
        o_proj: DeviceWeight,
        q_norm: CudaSlice<f32>,
        k_norm: CudaSlice<f32>,
    },
}

pub struct DeviceLayer {
    pub input_norm: CudaSlice<f32>,
    pub post_norm: CudaSlice<f32>,
    pub mixer: DeviceMixer,
    /// Rows: router (experts) | shared-expert gate (1).
    pub router: DeviceWeight,
    /// The router folded through the mixer's output projection, for decode (`out_proj_route`
    /// in moe.cu), made by [`DeviceModel::fold_routers`] where the layer allows it.
    pub router_fold: Option<RouterFold>,
    pub gate: DeviceWeight,
    pub up: DeviceWeight,
    pub down: DeviceWeight,
    pub shared_gate: DeviceWeight,
    pub shared_up: DeviceWeight,
    pub shared_down: DeviceWeight,
}

impl DeviceLayer {
    /// The mixer's output projection (DeltaNet's `out_proj`, attention's `o_proj`).
    pub fn mixer_output(&self) -> &DeviceWeight {
        match &self.mixer {
            DeviceMixer::DeltaNet { out_proj, .. } => out_proj,
            DeviceMixer::Attention { o_proj, .. } => o_proj,
        }
    }

    /// Whether one-token decode can fold the router into the mixer's output projection: the
    /// fold's rows are whole 16-byte bf16 chunks, and `moe_gate_up`, which then computes the
    /// shared expert's gate/up from the routed experts' staged input, reads them in the routed
    /// experts' format.
    fn router_folds(&self) -> bool {
        let o = self.mixer_output();
        o.rows == self.router.cols
            && o.cols.is_multiple_of(8)
            && self.router.cols.is_multiple_of(8)
            && self.shared_gate.format() == self.gate.format()
            && self.shared_up.format() == self.gate.format()
    }

    /// The expert matrices: routed gate, up, down, then the shared expert's.
    pub fn experts(&self) -> [&DeviceWeight; 6] {
        [
            &self.gate,
            &self.up,
            &self.down,
            &self.shared_gate,
            &self.shared_up,
            &self.shared_down,
        ]
    }
}

/// The host matrices each of a layer's device expert matrices is uploaded from, in
/// [`DeviceLayer::experts`]' order: the routed experts' stacked by rows, the shared expert's alone.
fn expert_parts(m: &MoeWeights) -> [Vec<&Matrix>; 6] {
    let routed = |part: fn(&FeedForward) -> &Matrix| m.experts.iter().map(part).collect();
    [
        routed(|e| &e.gate),
        routed(|e| &e.up),
        routed(|e| &e.down),
        vec![&m.shared_expert.gate],
        vec![&m.shared_expert.up],
        vec![&m.shared_expert.down],
    ]
}

pub struct DeviceModel {
    pub embed: DeviceWeight,
    pub layers: Vec<DeviceLayer>,
    pub final_norm: CudaSlice<f32>,
    pub lm_head: DeviceWeight,
}

impl DeviceModel {
    /// Uploads a loaded model with its scales in `scales`, reporting progress per layer through
    /// `progress`.
    pub fn upload(
        stream: &Arc<CudaStream>,
        model: &Model,
        scales: ScaleFormat,
        mut progress: impl FnMut(usize),
    ) -> Result<Self> {
        let f32s = |v: &[f32]| stream.clone_htod(v);
        let upload = |parts: &[&Matrix]| DeviceWeight::upload(stream, scales, parts);
        let mut layers = Vec::with_capacity(model.layers.len());
        for (i, l) in model.layers.iter().enumerate() {
            let mixer = match &l.mixer {
                Mixer::DeltaNet(w) => DeviceMixer::DeltaNet {
                    in_proj: upload(&[&w.in_proj_qkv, &w.in_proj_z, &w.in_proj_b, &w.in_proj_a])?,
                    out_proj: upload(&[&w.out_proj])?,
                    conv_w: f32s(&w.conv1d)?,
                    a_log: f32s(&w.a_log)?,
                    dt_bias: f32s(&w.dt_bias)?,
                    norm: f32s(&w.norm)?,
                },
                Mixer::Attention(w) => DeviceMixer::Attention {
                    qkv: upload(&[&w.q_proj, &w.k_proj, &w.v_proj])?,
                    o_proj: upload(&[&w.o_proj])?,
                    q_norm: f32s(&w.q_norm)?,
                    k_norm: f32s(&w.k_norm)?,
                },
            };
            let m = &l.moe;
            let [gate, up, down, shared_gate, shared_up, shared_down] = expert_parts(m);
            layers.push(DeviceLayer {
                input_norm: f32s(&l.input_norm)?,
                post_norm: f32s(&l.post_attention_norm)?,
                mixer,
                router: upload(&[&m.router, &m.shared_expert_gate])?,
                router_fold: None,
                gate: upload(&gate)?,
                up: upload(&up)?,
                down: upload(&down)?,
                shared_gate: upload(&shared_gate)?,
                shared_up: upload(&shared_up)?,
                shared_down: upload(&shared_down)?,
            });
            progress(i + 1);
        }
        Ok(Self {
            embed: upload(&[&model.embed_tokens])?,
            layers,
            final_norm: f32s(&model.final_norm)?,
            lm_head: upload(&[&model.lm_head])?,
        })
    }

    /// Random weights of `config`'s shapes, generated on the device.
    pub fn synthetic(
        stream: &Arc<CudaStream>,
        fill: &super::Fill,
        c: &ModelConfig,
        format: WeightFormat,
    ) -> Result<Self> {
        let mut seed = 0u64;
        let mut w = |rows: usize, cols: usize, format: WeightFormat| {
            seed += 1;
            DeviceWeight::random(stream, fill, rows, cols, format, seed)
        };
        // MLX keeps the routers at 8 bits.
        let router_format = match format {
            WeightFormat::Bf16 => WeightFormat::Bf16,
            WeightFormat::Affine { group, .. } => WeightFormat::Affine { bits: 8, group },
        };
        let h = c.hidden_size;
        let ones =
            |n: usize| -> Result<CudaSlice<f32>> { Ok(stream.clone_htod(&vec![1.0f32; n])?) };
        let mut layers = Vec::with_capacity(c.num_layers());
        for kind in &c.layer_kinds {
            let mixer = match kind {
                crate::config::LayerKind::LinearAttention => {
                    let hv = c.linear_num_value_heads;
                    let rows = c.linear_conv_dim() + c.linear_value_dim() + 2 * hv;
                    let conv: Vec<f32> = (0..c.linear_conv_dim() * c.linear_conv_kernel_dim)
                        .map(|i| ((i % 7) as f32 - 3.0) * 0.1)
                        .collect();
                    let a_log: Vec<f32> = (0..hv).map(|i| ((i % 16) as f32 + 1.0).ln()).collect();
                    DeviceMixer::DeltaNet {
                        in_proj: w(rows, h, format)?,
                        out_proj: w(h, c.linear_value_dim(), format)?,
                        conv_w: stream.clone_htod(&conv)?,
                        a_log: stream.clone_htod(&a_log)?,
                        dt_bias: ones(hv)?,
                        norm: ones(c.linear_value_head_dim)?,
                    }
                }
                crate::config::LayerKind::FullAttention => {
                    let (heads, kv, hd) =
                        (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
                    DeviceMixer::Attention {
                        qkv: w(heads * 2 * hd + 2 * kv * hd, h, format)?,
                        o_proj: w(h, heads * hd, format)?,
                        q_norm: ones(hd)?,
                        k_norm: ones(hd)?,
                    }
                }
            };
            let (e, inter, shared) = (
                c.num_experts,
                c.moe_intermediate_size,
                c.shared_expert_intermediate_size,
            );
            layers.push(DeviceLayer {
                input_norm: ones(h)?,
                post_norm: ones(h)?,
                mixer,
                router: w(e + 1, h, router_format)?,
                router_fold: None,
                gate: w(e * inter, h, format)?,
                up: w(e * inter, h, format)?,
                down: w(e * h, inter, format)?,
                shared_gate: w(shared, h, format)?,
                shared_up: w(shared, h, format)?,
                shared_down: w(h, shared, format)?,
            });
        }
        Ok(Self {
            embed: w(c.vocab_size, h, format)?,
            layers,
            final_norm: ones(h)?,
            lm_head: w(c.vocab_size, h, format)?,
        })
    }

    /// Folds each layer's router through its mixer's output projection where the layer allows
    /// it, for decode's `out_proj_route`: `fold_router` (moe.cu) sums it in f32 on the device,
    /// `fold_to_half` stores it. `fits`: whether the kernels' shared memory holds what the
    /// layer's fold needs.
    pub fn fold_routers(
        &mut self,
        stream: &Arc<CudaStream>,
        kernels: [&CudaFunction; 2],
        fits: impl Fn(&DeviceLayer) -> bool,
    ) -> Result<()> {
        let [fold_router, fold_to_half] = kernels;
        let mut sums: Option<CudaSlice<f32>> = None;
        for l in &mut self.layers {
            if !l.router_folds() || !fits(l) {
                continue;
            }
            let o = l.mixer_output();
            let (rows, cols) = (l.router.rows, o.cols + l.router.cols);
            if sums.as_ref().is_none_or(|s| s.len() < rows * cols) {
                sums = Some(stream.alloc_zeros::<f32>(rows * cols)?);
            }
            let f32s = ptr(sums.as_ref().expect("allocated above"), stream);
            let (router, out_proj) = (l.router.desc(stream), o.desc(stream));
            let post = ptr(&l.post_norm, stream);
            let mut b = stream.launch_builder(fold_router);
            b.arg(&router).arg(&out_proj).arg(&post).arg(&f32s);
            let grid = (cols.div_ceil(256) as u32, rows.div_ceil(FOLD_TILE) as u32);
            // SAFETY: `sums` holds at least rows x cols floats; the router is [rows, hidden] and
            // the projection [hidden, o.cols] (router_folds), post_norm hidden floats.
            unsafe { b.launch(cfg(grid.0, grid.1, 256, 0)) }?;
            let data = stream.alloc_zeros::<u8>(rows * cols * 2)?;
            let row_scale = stream.alloc_zeros::<f32>(rows)?;
            let (out, scale) = (ptr(&data, stream), ptr(&row_scale, stream));
            let cols32 = cols as i32;
            let mut b = stream.launch_builder(fold_to_half);
            b.arg(&f32s).arg(&cols32).arg(&out).arg(&scale);
            // SAFETY: one block per row of `sums`, writing that row of `data` (rows x cols fp16
            // values) and its scale.
            unsafe { b.launch(cfg(rows as u32, 1, 256, 0)) }?;
            l.router_fold = Some(RouterFold {
                data,
                row_scale,
                rows,
                cols,
            });
        }
        Ok(())
    }

    /// The one format every layer's expert matrices (routed and shared gate, up and down) are
    /// stored in, if they share one.
    pub fn expert_format(&self) -> Option<WeightFormat> {
        common_format(
            self.layers
                .iter()
                .flat_map(|l| l.experts().map(DeviceWeight::format)),
        )
    }

    /// What [`Self::expert_format`] will be once `model` is uploaded.
    pub fn expert_format_of_upload(model: &Model) -> Option<WeightFormat> {
        common_format(
            model
                .layers
                .iter()
                .flat_map(|l| expert_parts(&l.moe).map(|parts| upload_format(&parts))),
        )
    }

    /// Bytes of weight memory on the device, norm and gate vectors included.
    pub fn bytes(&self) -> usize {
        let mut total = self.embed.bytes() + self.lm_head.bytes() + self.final_norm.num_bytes();
        for l in &self.layers {
            total += l.input_norm.num_bytes() + l.post_norm.num_bytes();
            total += l.router.bytes() + l.experts().iter().map(|w| w.bytes()).sum::<usize>();
            total += l.router_fold.as_ref().map_or(0, RouterFold::bytes);
            total += match &l.mixer {
                DeviceMixer::DeltaNet {
                    in_proj,
                    out_proj,
                    conv_w,
                    a_log,
                    dt_bias,
                    norm,
                } => {
                    in_proj.bytes()
                        + out_proj.bytes()
                        + [conv_w, a_log, dt_bias, norm]
                            .iter()
                            .map(|v| v.num_bytes())
                            .sum::<usize>()
                }
                DeviceMixer::Attention {
                    qkv,
                    o_proj,
                    q_norm,
                    k_norm,
                } => qkv.bytes() + o_proj.bytes() + q_norm.num_bytes() + k_norm.num_bytes(),
            };
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::{ConvertOptions, DEFAULT_MAX_SHARD_BYTES, convert};
    use crate::quant::QuantSpec;

    #[test]
    fn the_experts_format_is_what_upload_stores_them_in() {
        let source =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-text");
        let dense = Model::load(&source).unwrap();
        // Dense experts upload as bf16.
        assert_eq!(
            DeviceModel::expert_format_of_upload(&dense),
            Some(WeightFormat::Bf16)
        );
        let dir = tempfile::tempdir().unwrap();
        let options = ConvertOptions {
            spec: QuantSpec::new(4, 64).unwrap(),
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            progress: false,
        };
        let out = dir.path().join("q4");
        convert(&source, &out, &options).unwrap();
        let mut quantized = Model::load(&out).unwrap();
        let q4 = WeightFormat::Affine { bits: 4, group: 64 };
        assert_eq!(DeviceModel::expert_format_of_upload(&quantized), Some(q4));
        // The routers are 8-bit, but they are not experts.
        assert_eq!(
            upload_format(&[&quantized.layers[0].moe.router]),
            WeightFormat::Affine { bits: 8, group: 64 }
        );
        // One dense expert makes its layer's stacked gates bf16: the experts share no format.
        let last = quantized.layers.len() - 1;
        quantized.layers[last].moe.experts[1].gate = dense.layers[last].moe.experts[1].gate.clone();
        let gates: Vec<&Matrix> = quantized.layers[last]
            .moe
            .experts
            .iter()
            .map(|e| &e.gate)
            .collect();
        assert_eq!(upload_format(&gates), WeightFormat::Bf16);
        assert_eq!(DeviceModel::expert_format_of_upload(&quantized), None);
    }

    #[test]
    fn bf16_values_fit_fp16_up_to_its_largest() {
        let fits = |v: f32| bf16_fits_fp16(half::bf16::from_f32(v).to_bits());
        // fp16's largest is 65504; the bf16 values around it are 65280 and 65536.
        for v in [0.0, -0.0, 1.0, -3.5, 65280.0, -65280.0, 1e-30, -1e-30] {
            assert!(fits(v), "{v}");
        }
        for v in [
            65536.0,
            -65536.0,
            1e30,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ] {
            assert!(!fits(v), "{v}");
        }
        assert_eq!(half::bf16::from_f32(65504.0).to_f32(), 65536.0);
    }

    fn bytes_of(dtype: DType, values: &[f32]) -> Vec<u8> {
        values
            .iter()
            .flat_map(|&v| match dtype {
                DType::BF16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                DType::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                DType::F32 => v.to_le_bytes().to_vec(),
            })
            .collect()
    }

    /// The chosen format, and every value as the kernels will read it.
    fn chosen(stored: &[(DType, Vec<f32>)]) -> (ScaleFormat, Vec<f32>) {
        let bytes: Vec<(DType, Vec<u8>)> =
            stored.iter().map(|(d, v)| (*d, bytes_of(*d, v))).collect();
        let sets: Vec<(DType, [&[u8]; 2])> = bytes
            .iter()
            .map(|(d, b)| (*d, [b.as_slice(), b.as_slice()]))
            .collect();
        let format = ScaleFormat::for_stored(&sets);
        let mut bits = Vec::new();
        for (d, b) in &bytes {
            format.encode(*d, b, &mut bits);
        }
        (format, bits.iter().map(|&b| format.value(b)).collect())
    }

    /// Values as a dtype stores them.
    fn stored_as(dtype: DType, values: &[f32]) -> Vec<f32> {
        let bytes = bytes_of(dtype, values);
        let mut out = vec![0.0; values.len()];
        convert_to_f32(dtype, &bytes, &mut out);
        out
    }

    #[test]
    fn scales_keep_the_checkpoints_16_bit_format_exactly() {
        // Values with more mantissa than bf16 holds, and some outside fp16's range.
        let values = [0.012_345_679, -0.000_987_654_3, 3.0e-6, 1.5, -77.7];
        for dtype in [DType::BF16, DType::F16] {
            let want = stored_as(dtype, &values);
            let (format, got) = chosen(&[(dtype, want.clone()), (dtype, want.clone())]);
            let expected = if dtype == DType::BF16 {
                ScaleFormat::Bf16
            } else {
                ScaleFormat::F16
            };
            assert_eq!(format, expected);
            assert_eq!(
                got,
                [want.clone(), want].concat(),
                "{dtype:?} scales changed"
            );
        }
    }

    #[test]
    fn f32_and_mixed_scales_take_the_format_that_rounds_them_least() {
        // Ordinary scales: fp16 keeps three more bits.
        let ordinary = [0.012_345_679, -0.003_141_592_6, 0.25, 1.0e-3];
        let (format, got) = chosen(&[(DType::F32, ordinary.to_vec())]);
        assert_eq!(format, ScaleFormat::F16);
        for (g, v) in got.iter().zip(ordinary) {
            assert!(((g - v) / v).abs() <= 1.0 / 2048.0, "{g} for {v}");
        }
        // Tiny biases fall into fp16's subnormals (and large values past its range): bf16.
        for odd in [1.0e-7, 1.0e5] {
            let (format, _) = chosen(&[(DType::F32, vec![0.01, odd])]);
            assert_eq!(format, ScaleFormat::Bf16, "with {odd}");
        }
        // bf16 values inside fp16's normal range are exact in fp16, so a bf16 + fp16 mix stays
        // exact there.
        let bf16_part = stored_as(DType::BF16, &[0.0123, -0.5, 2.0]);
        let f16_part = stored_as(DType::F16, &[0.012_345_679, 0.001]);
        let (format, got) = chosen(&[
            (DType::BF16, bf16_part.clone()),
            (DType::F16, f16_part.clone()),
        ]);
        assert_eq!(format, ScaleFormat::F16);
        assert_eq!(got, [bf16_part, f16_part].concat());
    }
}

//! The model's weights in device memory, laid out for the decode kernels.
//!
//! Matrices that read the same input are concatenated by rows at upload so one launch computes
//! them all: the DeltaNet input projections (qkv | z | b | a), the attention projections
//! (q+gate | k | v) and the router with the shared-expert gate. Routed experts are stacked:
//! gate and up `[experts * intermediate, hidden]`, down `[experts * hidden, intermediate]`.
//! Dense weights are stored as bf16, quantised ones in MLX's affine format with bf16 scales and
//! biases; small vectors (norm scales, conv taps, gates) as f32.

use std::sync::Arc;

use anyhow::{Result, ensure};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr};

use crate::checkpoint::{DType, convert_to_f32};
use crate::config::ModelConfig;
use crate::model::{Matrix, Mixer, Model, QuantizedStorage, Storage};

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

pub fn ptr<T>(slice: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    slice.device_ptr(stream).0
}

impl DeviceWeight {
    /// Uploads the row-concatenation of `parts` as one device matrix. Quantised parts that share
    /// one setting stay in MLX's format (scales and biases as bf16); dense parts, or parts
    /// quantised differently from each other, are stored as bf16.
    pub fn upload(stream: &Arc<CudaStream>, parts: &[&Matrix]) -> Result<Self> {
        let cols = parts[0].cols;
        ensure!(
            parts.iter().all(|m| m.cols == cols),
            "fused matrices differ in width"
        );
        let rows: usize = parts.iter().map(|m| m.rows).sum();
        let quantized: Option<Vec<&QuantizedStorage>> = parts
            .iter()
            .map(|m| match &m.storage {
                Storage::Quantized(q) => Some(q),
                Storage::Dense { .. } => None,
            })
            .collect();
        if let Some(qs) = quantized
            && qs.iter().all(|q| q.spec == qs[0].spec)
        {
            return Self::upload_quantized(stream, &qs, rows, cols);
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
        Ok(Self::bf16(stream.clone_htod(&host)?, rows, cols))
    }

    /// A dense bf16 matrix already on the device.
    fn bf16(data: CudaSlice<u8>, rows: usize, cols: usize) -> Self {
        Self {
            data,
            scales: None,
            biases: None,
            rows,
            cols,
            bits: 16,
            group: 0,
        }
    }

    fn upload_quantized(
        stream: &Arc<CudaStream>,
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
            for (src, dst) in [(&q.scales, &mut scales), (&q.biases, &mut biases)] {
                let mut f = vec![0.0f32; src.as_slice().len() / q.scale_dtype.size()];
                convert_to_f32(q.scale_dtype, src.as_slice(), &mut f);
                dst.extend(f.iter().map(|v| half::bf16::from_f32(*v).to_bits()));
            }
        }
        Ok(Self {
            data: stream.clone_htod(&words)?,
            scales: Some(stream.clone_htod(&scales)?),
            biases: Some(stream.clone_htod(&biases)?),
            rows,
            cols,
            bits: spec.bits as usize,
            group: spec.group_size,
        })
    }

    /// Device memory the weight occupies, in bytes.
    pub fn bytes(&self) -> usize {
        // Scales and biases: one bf16 each per group.
        self.data.len() + 2 * 2 * self.scales.as_ref().map_or(0, |s| s.len())
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
                Ok(Self::bf16(data, rows, cols))
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
                })
            }
        }
    }
}

/// How synthetic weights are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    Bf16,
    Affine { bits: usize, group: usize },
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
    pub gate: DeviceWeight,
    pub up: DeviceWeight,
    pub down: DeviceWeight,
    pub shared_gate: DeviceWeight,
    pub shared_up: DeviceWeight,
    pub shared_down: DeviceWeight,
}

pub struct DeviceModel {
    pub embed: DeviceWeight,
    pub layers: Vec<DeviceLayer>,
    pub final_norm: CudaSlice<f32>,
    pub lm_head: DeviceWeight,
}

impl DeviceModel {
    /// Uploads a loaded model, reporting progress per layer through `progress`.
    pub fn upload(
        stream: &Arc<CudaStream>,
        model: &Model,
        mut progress: impl FnMut(usize),
    ) -> Result<Self> {
        let f32s = |v: &[f32]| stream.clone_htod(v);
        let mut layers = Vec::with_capacity(model.layers.len());
        for (i, l) in model.layers.iter().enumerate() {
            let mixer = match &l.mixer {
                Mixer::DeltaNet(w) => DeviceMixer::DeltaNet {
                    in_proj: DeviceWeight::upload(
                        stream,
                        &[&w.in_proj_qkv, &w.in_proj_z, &w.in_proj_b, &w.in_proj_a],
                    )?,
                    out_proj: DeviceWeight::upload(stream, &[&w.out_proj])?,
                    conv_w: f32s(&w.conv1d)?,
                    a_log: f32s(&w.a_log)?,
                    dt_bias: f32s(&w.dt_bias)?,
                    norm: f32s(&w.norm)?,
                },
                Mixer::Attention(w) => DeviceMixer::Attention {
                    qkv: DeviceWeight::upload(stream, &[&w.q_proj, &w.k_proj, &w.v_proj])?,
                    o_proj: DeviceWeight::upload(stream, &[&w.o_proj])?,
                    q_norm: f32s(&w.q_norm)?,
                    k_norm: f32s(&w.k_norm)?,
                },
            };
            let m = &l.moe;
            let gates: Vec<&Matrix> = m.experts.iter().map(|e| &e.gate).collect();
            let ups: Vec<&Matrix> = m.experts.iter().map(|e| &e.up).collect();
            let downs: Vec<&Matrix> = m.experts.iter().map(|e| &e.down).collect();
            layers.push(DeviceLayer {
                input_norm: f32s(&l.input_norm)?,
                post_norm: f32s(&l.post_attention_norm)?,
                mixer,
                router: DeviceWeight::upload(stream, &[&m.router, &m.shared_expert_gate])?,
                gate: DeviceWeight::upload(stream, &gates)?,
                up: DeviceWeight::upload(stream, &ups)?,
                down: DeviceWeight::upload(stream, &downs)?,
                shared_gate: DeviceWeight::upload(stream, &[&m.shared_expert.gate])?,
                shared_up: DeviceWeight::upload(stream, &[&m.shared_expert.up])?,
                shared_down: DeviceWeight::upload(stream, &[&m.shared_expert.down])?,
            });
            progress(i + 1);
        }
        Ok(Self {
            embed: DeviceWeight::upload(stream, &[&model.embed_tokens])?,
            layers,
            final_norm: f32s(&model.final_norm)?,
            lm_head: DeviceWeight::upload(stream, &[&model.lm_head])?,
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

    /// Bytes of weight memory on the device.
    pub fn bytes(&self) -> usize {
        let mut total = self.embed.bytes() + self.lm_head.bytes();
        for l in &self.layers {
            total += [
                &l.router,
                &l.gate,
                &l.up,
                &l.down,
                &l.shared_gate,
                &l.shared_up,
                &l.shared_down,
            ]
            .iter()
            .map(|w| w.bytes())
            .sum::<usize>();
            total += match &l.mixer {
                DeviceMixer::DeltaNet {
                    in_proj, out_proj, ..
                } => in_proj.bytes() + out_proj.bytes(),
                DeviceMixer::Attention { qkv, o_proj, .. } => qkv.bytes() + o_proj.bytes(),
            };
        }
        total
    }
}

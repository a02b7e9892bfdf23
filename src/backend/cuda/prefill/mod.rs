//! Prefill: a prompt goes through the model a chunk of tokens at a time, layer by layer over the
//! whole chunk. Projections with 4- and 8-bit or bf16 weights run on tensor cores for the chunk
//! at once (gemm.rs), the MoE grouped by expert; attention is causal flash attention on tensor
//! cores (`attention_prefill`); the DeltaNet recurrence runs in its chunkwise form (64-token
//! sub-chunks as matrix products on tensor cores, the state carried from one to the next). Other
//! weight formats run the decode kernels with the chunk's tokens along a grid dimension. Scratch
//! is sized for one chunk, so a prompt of any length fits.

mod deltanet;
mod moe;

use anyhow::{Context, Result, ensure};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use deltanet::GDN_CHUNK;
use moe::{ROUTER_SPLITS, max_group_tiles};

use super::gemm::{GEMM_GROUP_TOKENS, on_tensor_cores};
use super::shapes::{
    AttentionDims, DeltaNetDims, DeltaNetShape, attention_tile_row, moe_slot_width,
};
use super::timing::PrefillPart;
use super::weights::{DeviceMixer, DeviceWeight, ptr};
use super::{
    AttentionBuffers, CudaBackend, CudaState, DeltaNetParams, MmaStaging, NO_BATCH_CONTEXT,
    NO_TABLE, StepSeqs, arg, cfg,
};
use crate::backend::LogitsFor;
use crate::config::ModelConfig;

/// Token rows up to which a projection runs the decode mat-vec per token instead of the
/// tensor-core product.
const MATVEC_MAX_TOKENS: usize = 4;
/// Rows of logits computed at a time when every position's logits are asked for.
const LOGITS_ROWS: usize = 128;
/// Query tokens per `attention_prefill` block (PREFILL_QUERY_TILE in attention.cu).
const ATTENTION_QUERY_TILE: usize = 64;
/// Key positions per step of `attention_prefill` (PREFILL_KEY_TILE).
const ATTENTION_KEY_TILE: usize = 64;
/// Threads of an `attention_prefill` block (PREFILL_THREADS: a warp per 16 query rows).
const ATTENTION_PREFILL_THREADS: u32 = 128;

/// Activations of one prefill chunk, row per token. The mixer's and the MoE's pieces share one
/// allocation: a layer's mixer is done with its pieces before its MoE starts, and nothing in
/// them outlives the layer. At 4,096-token chunks of the full-size model that saves ~0.6 GB.
pub(super) struct PrefillScratch {
    tokens: CudaSlice<i32>,
    x: CudaSlice<f32>,
    /// Inputs of a tensor-core product in fp16, and each token's power-of-two scale.
    x16: CudaSlice<u16>,
    xscale: CudaSlice<f32>,
    /// The storage `mixer` and `moe` point into.
    layer: CudaSlice<u8>,
    mixer: MixerScratch,
    moe: MoeScratch,
}

/// Device addresses of the mixer's pieces (in `PrefillScratch::layer`).
struct MixerScratch {
    /// The input projection's output and the mixer's output, before the out projection.
    proj: u64,
    core: u64,
    /// Attention: the normed, rotated queries.
    q: u64,
    /// DeltaNet: the convolved, activated q|k|v of every token, its (beta, log decay) per value
    /// head, and the recurrence's output before the gated norm.
    gdn_act: u64,
    gdn_gates: u64,
    gdn_raw: u64,
    /// Chunkwise DeltaNet, per token and value head: the log decay summed from its sub-chunk's
    /// start (in fp64), W (key_dim floats) and U, which deltanet_chunk_state turns into V' in place
    /// (value_dim floats).
    gdn_gcum: u64,
    gdn_w: u64,
    gdn_values: u64,
}

/// Device addresses of the MoE's pieces (in `PrefillScratch::layer`).
#[derive(Clone, Copy)]
struct MoeScratch {
    router_logits: u64,
    ids: u64,
    weights: u64,
    /// The decode kernels' activations (formats off the tensor cores).
    act: u64,
    /// Grouped MoE: assignments (token * top_k + slot) sorted by expert, the expert tiles over
    /// them and their count, each assignment's gate and up rows, its activation in fp16 (and
    /// scale), and its down row (over the gate and up rows, done with by then).
    order: u64,
    tiles: u64,
    tile_count: u64,
    gate_rows: u64,
    up_rows: u64,
    act16: u64,
    actscale: u64,
    down_rows: u64,
}

/// Carves consecutive pieces, 256-byte aligned, out of an allocation starting at `base` (at 0,
/// it measures the allocation a layout needs).
#[derive(Clone, Copy)]
struct Region {
    base: u64,
    used: usize,
}

impl Region {
    fn take<T>(&mut self, len: usize) -> u64 {
        let at = self.base + self.used as u64;
        self.used += (len.max(1) * std::mem::size_of::<T>()).next_multiple_of(256);
        at
    }

    /// Continues after the longer of two alternative layouts that started at the same place.
    fn after(self, other: Region) -> Region {
        Region {
            base: self.base,
            used: self.used.max(other.used),
        }
    }
}

impl MixerScratch {
    fn carve(c: &ModelConfig, n: usize, r: &mut Region) -> Self {
        // The chunkwise DeltaNet kernels write whole sub-chunks.
        let whole_sub_chunks = n.div_ceil(GDN_CHUNK) * GDN_CHUNK;
        let heads_hd = c.num_attention_heads * c.head_dim;
        let proj = (c.linear_conv_dim() + c.linear_value_dim() + 2 * c.linear_num_value_heads)
            .max(2 * heads_hd + 2 * c.num_key_value_heads * c.head_dim);
        let proj = r.take::<f32>(n * proj);
        let core = r.take::<f32>(n * c.linear_value_dim().max(heads_hd));
        // Attention and DeltaNet layers use their own pieces over the same storage.
        let mut attention = *r;
        let q = attention.take::<f32>(n * heads_hd);
        let heads = c.linear_num_value_heads;
        let mixer = Self {
            proj,
            core,
            q,
            gdn_act: r.take::<f32>(n * c.linear_conv_dim()),
            gdn_gates: r.take::<f32>(n * 2 * heads),
            gdn_raw: r.take::<f32>(n * c.linear_value_dim()),
            gdn_gcum: r.take::<f64>(n * heads),
            gdn_w: r.take::<f32>(whole_sub_chunks * heads * c.linear_key_head_dim),
            gdn_values: r.take::<f32>(whole_sub_chunks * c.linear_value_dim()),
        };
        *r = r.after(attention);
        mixer
    }
}

impl MoeScratch {
    fn carve(c: &ModelConfig, n: usize, r: &mut Region) -> Self {
        let inter = moe_slot_width(c);
        let (top_k, slots) = (c.num_experts_per_tok, c.num_experts_per_tok + 1);
        let router_logits = r.take::<f32>(ROUTER_SPLITS * n * (c.num_experts + 1));
        let ids = r.take::<i32>(n * slots);
        let weights = r.take::<f32>(n * slots);
        // The decode kernels' path and the grouped path use their own pieces over the same
        // storage.
        let mut decode = *r;
        let act = decode.take::<f32>(n * slots * inter);
        let order = r.take::<i32>(n * top_k);
        let tiles = r.take::<i32>(3 * max_group_tiles(c, n, GEMM_GROUP_TOKENS));
        let tile_count = r.take::<i32>(1);
        let act16 = r.take::<u16>(n * top_k * inter);
        let actscale = r.take::<f32>(n * top_k);
        let mut rows = *r;
        let gate_rows = r.take::<f32>(n * top_k * inter);
        let up_rows = r.take::<f32>(n * top_k * inter);
        let down_rows = rows.take::<f32>(n * top_k * c.hidden_size);
        *r = r.after(rows).after(decode);
        Self {
            router_logits,
            ids,
            weights,
            act,
            order,
            tiles,
            tile_count,
            gate_rows,
            up_rows,
            act16,
            actscale,
            down_rows,
        }
    }
}

/// The pieces of the prefill scratch that the grouped routed experts use, by device address
/// (`routed_experts_grouped`): large decode batches' steps use them too, without the scratch's
/// lock. Graphs capture addresses, and everything runs on the backend's one stream, so prefill
/// chunks and decode steps take turns.
#[derive(Clone, Copy)]
pub(super) struct GroupedExperts {
    moe: MoeScratch,
    x16: u64,
    xscale: u64,
}

impl PrefillScratch {
    /// The device addresses of the grouped routed experts' pieces.
    pub(super) fn grouped_experts(&self, s: &CudaStream) -> GroupedExperts {
        GroupedExperts {
            moe: self.moe,
            x16: ptr(&self.x16, s),
            xscale: ptr(&self.xscale, s),
        }
    }

    /// Device memory the scratch holds.
    pub(super) fn bytes(&self) -> usize {
        self.tokens.num_bytes()
            + self.x.num_bytes()
            + self.x16.num_bytes()
            + self.xscale.num_bytes()
            + self.layer.num_bytes()
    }

    /// Scratch for chunks of up to `n` tokens of the model `c`.
    pub(super) fn new(stream: &Arc<CudaStream>, c: &ModelConfig, n: usize) -> Result<Self> {
        let widest = c
            .hidden_size
            .max(c.linear_value_dim())
            .max(c.num_attention_heads * c.head_dim)
            .max(c.moe_intermediate_size)
            .max(c.shared_expert_intermediate_size);
        let layout = |base: u64| {
            let (mut mixer, mut moe) = (Region { base, used: 0 }, Region { base, used: 0 });
            let pieces = (
                MixerScratch::carve(c, n, &mut mixer),
                MoeScratch::carve(c, n, &mut moe),
            );
            (pieces, mixer.after(moe).used)
        };
        let layer = stream.alloc_zeros::<u8>(layout(0).1)?;
        let ((mixer, moe), _) = layout(ptr(&layer, stream));
        Ok(Self {
            tokens: stream.alloc_zeros::<i32>(n)?,
            x: stream.alloc_zeros::<f32>(n * c.hidden_size)?,
            // Also the staging of the few-token products (`matvec_mma`, see project_split).
            x16: stream.alloc_zeros::<u16>((n * widest).max(MmaStaging::halves(n, widest)))?,
            xscale: stream.alloc_zeros::<f32>(MmaStaging::rows(n))?,
            layer,
            mixer,
            moe,
        })
    }
}

impl CudaBackend {
    /// Runs `tokens` (at most the prefill chunk) from the state's position and returns the logits of
    /// every token (`LogitsFor::All`), of the last, or none (a chunk before a prompt's last).
    pub(super) fn prefill_chunk(
        &self,
        state: &mut CudaState,
        tokens: &[u32],
        which: Option<LogitsFor>,
    ) -> Result<Vec<f32>> {
        let n = tokens.len();
        ensure!(
            (1..=self.prefill_chunk).contains(&n),
            "a prefill chunk holds 1 to {} tokens",
            self.prefill_chunk
        );
        let c = &self.config;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            anyhow::bail!(
                "token id {bad} is outside the vocabulary (size {})",
                c.vocab_size
            );
        }
        ensure!(
            state.position + n <= self.max_context,
            "the prompt needs {} positions; the context limit is {} tokens",
            state.position + n,
            self.max_context
        );
        let mut guard = self
            .prefill
            .lock()
            .map_err(|_| anyhow::anyhow!("prefill scratch lock poisoned"))?;
        let ps = &mut *guard;
        let slots = self.lock_slots()?;
        let slot = &slots[state.slot];
        let s = &self.stream;
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        s.memcpy_htod(&ids, &mut ps.tokens)?;

        let m = &self.model;
        let p = |x: &CudaSlice<f32>| ptr(x, s);
        let (x, proj, core) = (p(&ps.x), ps.mixer.proj, ps.mixer.core);
        let position = ptr(&slot.position, s);
        let token_ids = ptr(&ps.tokens, s);
        let n32 = n as i32;
        let embed = m.embed.desc(s);
        // SAFETY: x holds prefill_chunk rows of hidden_size floats; token ids checked above.
        unsafe {
            self.launch(
                "embed",
                &self.k.embed,
                cfg(c.hidden_size.div_ceil(256) as u32, n as u32, 256, 0),
                &mut [
                    arg(&embed),
                    arg(&token_ids),
                    arg(&x),
                    arg(&NO_TABLE),
                    arg(&NO_TABLE),
                    arg(&NO_BATCH_CONTEXT),
                ],
            )
        }?;
        self.mark(PrefillPart::Projections)?;

        let gdn = DeltaNetShape::of(c).context("DeltaNet shape checked at construction")?;
        let gdn_dims = DeltaNetDims::new(c, gdn.splits);
        // No context splits: attention_prefill walks each query tile's keys in one block.
        let attn_dims = AttentionDims::new(c, self.max_context, 1);
        let (mut attn_i, mut gdn_i) = (0, 0);
        for layer in &m.layers {
            match &layer.mixer {
                DeviceMixer::DeltaNet {
                    in_proj,
                    out_proj,
                    conv_w,
                    a_log,
                    dt_bias,
                    norm,
                } => {
                    self.project(ps, in_proj, x, Some(p(&layer.input_norm)), proj, false, n)?;
                    self.mark(PrefillPart::Projections)?;
                    let weights = [conv_w, a_log, dt_bias, norm];
                    let params = DeltaNetParams::new(
                        &gdn_dims,
                        weights,
                        StepSeqs::Slot(slot),
                        gdn_i,
                        proj,
                        core,
                        s,
                    );
                    self.deltanet_chunk(ps, &params, n)?;
                    self.mark(PrefillPart::DeltaNet)?;
                    self.project(ps, out_proj, core, None, x, true, n)?;
                    self.mark(PrefillPart::Projections)?;
                    gdn_i += 1;
                }
                DeviceMixer::Attention {
                    qkv,
                    o_proj,
                    q_norm,
                    k_norm,
                } => {
                    self.project(ps, qkv, x, Some(p(&layer.input_norm)), proj, false, n)?;
                    self.mark(PrefillPart::Projections)?;
                    let norms = [q_norm, k_norm];
                    let attn = AttentionBuffers::new(
                        norms,
                        StepSeqs::Slot(slot),
                        attn_i,
                        proj,
                        ps.mixer.q,
                        core,
                        s,
                    );
                    self.attention_chunk(&attn_dims, &attn, n)?;
                    self.mark(PrefillPart::Attention)?;
                    self.project(ps, o_proj, core, None, x, true, n)?;
                    self.mark(PrefillPart::Projections)?;
                    attn_i += 1;
                }
            }
            self.moe_chunk(ps, layer, x, n)?;
            self.mark(PrefillPart::Moe)?;
        }
        let by = n32;
        // SAFETY: one thread advances the slot's position.
        unsafe {
            self.launch(
                "advance_position",
                &self.k.advance_position,
                cfg(1, 1, 1, 0),
                &mut [arg(&position), arg(&by), arg(&NO_TABLE)],
            )
        }?;
        state.position += n;
        state.device_token = None;
        self.mark(PrefillPart::Projections)?;

        let final_norm = Some(p(&m.final_norm));
        match which {
            None => Ok(Vec::new()),
            Some(LogitsFor::All) => {
                let rows = s.alloc_zeros::<f32>(LOGITS_ROWS.min(n) * c.vocab_size)?;
                let out = ptr(&rows, s);
                let mut all = Vec::with_capacity(n * c.vocab_size);
                for first in (0..n).step_by(LOGITS_ROWS) {
                    let count = LOGITS_ROWS.min(n - first);
                    let from = x + (first * c.hidden_size * 4) as u64;
                    self.project(ps, &m.lm_head, from, final_norm, out, false, count)?;
                    let part = s.clone_dtoh(&rows)?;
                    all.extend_from_slice(&part[..count * c.vocab_size]);
                }
                self.mark(PrefillPart::LmHead)?;
                Ok(all)
            }
            Some(LogitsFor::Last) => {
                let last = x + ((n - 1) * c.hidden_size * 4) as u64;
                let out = p(&self.scratch.logits);
                self.project(ps, &m.lm_head, last, final_norm, out, false, 1)?;
                self.mark(PrefillPart::LmHead)?;
                Ok(s.clone_dtoh(&self.scratch.logits.slice(..c.vocab_size))?)
            }
        }
    }

    /// One attention layer for a chunk of `n` tokens: attention_prepare (q/k norms, RoPE, the
    /// cache append), then causal flash attention on tensor cores with the output gate.
    fn attention_chunk(&self, dims: &AttentionDims, b: &AttentionBuffers, n: usize) -> Result<()> {
        let c = &self.config;
        self.attention_prepare(dims, b, n)?;
        let tiles = n.div_ceil(ATTENTION_QUERY_TILE) as u32;
        let n32 = n as i32;
        let smem = attention_prefill_smem(c.head_dim);
        // SAFETY: q, proj and out hold n rows; the kernel reads cache rows below position + n,
        // which the host checked against max_context; smem is the kernel's tiles for head_dim,
        // within the MAX_DYNAMIC_SHARED_BYTES set for it at start-up (see the test below).
        unsafe {
            self.launch(
                "attention_prefill",
                &self.k.attention_prefill,
                cfg(
                    c.num_attention_heads as u32,
                    tiles,
                    ATTENTION_PREFILL_THREADS,
                    smem,
                ),
                &mut [
                    arg(dims),
                    arg(&b.q),
                    arg(&b.k_cache),
                    arg(&b.v_cache),
                    arg(&b.position),
                    arg(&b.proj),
                    arg(&n32),
                    arg(&b.out),
                ],
            )
        }
    }

    /// y = W · x for `n` token rows (x RMS-normalised by `norm` when given; added to y when
    /// `accumulate`): on tensor cores for 4- and 8-bit weights and more than MATVEC_MAX_TOKENS
    /// rows, else the decode mat-vec per token.
    #[allow(clippy::too_many_arguments)]
    fn project(
        &self,
        ps: &PrefillScratch,
        w: &DeviceWeight,
        x: u64,
        norm: Option<u64>,
        y: u64,
        accumulate: bool,
        n: usize,
    ) -> Result<()> {
        self.project_split(ps, w, x, norm, y, accumulate, n, 1)?;
        Ok(())
    }

    /// As `project`, the tensor-core product split `splits` ways along k: with more than one,
    /// y holds `splits` slices of n rows of partial sums, for the reader to add up (and cannot
    /// accumulate). Returns the slices written: `splits`, or 1 where the mat-vec takes the
    /// product.
    #[allow(clippy::too_many_arguments)]
    fn project_split(
        &self,
        ps: &PrefillScratch,
        w: &DeviceWeight,
        x: u64,
        norm: Option<u64>,
        y: u64,
        accumulate: bool,
        n: usize,
        splits: usize,
    ) -> Result<usize> {
        let s = &self.stream;
        // A few rows (the last position's logits, short prompts) read the weights once either
        // way, and the mat-vec reads them at full bandwidth without padding the token tile.
        if on_tensor_cores(w) && n > MATVEC_MAX_TOKENS {
            let (x16, xs) = (ptr(&ps.x16, s), ptr(&ps.xscale, s));
            self.rows_to_half(x, w.cols, norm, w.bits, n, x16, xs)?;
            self.gemm_rows_split(w, x16, xs, n, y, accumulate, splits)?;
            Ok(splits)
        } else {
            let staging = MmaStaging::of(&ps.x16, &ps.xscale, s);
            self.matvec_staged(
                "prefill_matvec",
                w,
                x,
                norm,
                y,
                accumulate.then_some(y),
                n,
                staging,
            )?;
            Ok(1)
        }
    }
}

/// Dynamic shared memory of `attention_prefill`: its query, key and value tiles in bf16, rows of
/// `attention_tile_row` values.
fn attention_prefill_smem(head_dim: usize) -> u32 {
    ((ATTENTION_QUERY_TILE + 2 * ATTENTION_KEY_TILE) * attention_tile_row(head_dim) * 2) as u32
}

#[cfg(test)]
mod tests {
    use super::super::shapes::MAX_DYNAMIC_SHARED_BYTES;
    use super::*;

    #[test]
    fn attention_prefill_tiles_fit_two_blocks_per_sm() {
        // head_dim 256: Q, K and V tiles of 64 rows of 256 + 8 bf16.
        let full = attention_prefill_smem(256) as usize;
        assert_eq!(full, 3 * 64 * 264 * 2);
        assert!(full <= MAX_DYNAMIC_SHARED_BYTES);
        // An H200 SM has 228 KB of shared memory, 1 KB of it reserved per block.
        assert!(2 * (full + 1024) <= 228 * 1024);
        // Other widths round up to an instantiated one.
        assert_eq!(attention_prefill_smem(32), 3 * 64 * 40 * 2);
        assert_eq!(attention_prefill_smem(96), attention_prefill_smem(128));
    }

    #[test]
    fn regions_carve_aligned_pieces_and_continue_after_the_longer_layout() {
        let mut r = Region {
            base: 4096,
            used: 0,
        };
        assert_eq!(r.take::<f32>(3), 4096);
        assert_eq!(r.take::<f64>(0), 4096 + 256);
        let mut other = r;
        assert_eq!(other.take::<u16>(1000), 4096 + 512);
        assert_eq!(r.take::<i32>(1), 4096 + 512);
        let r = r.after(other);
        assert_eq!(r.used, 512 + 2048);
    }

    #[test]
    fn layer_pieces_share_storage_only_across_phases() {
        let c =
            ModelConfig::from_json_str(include_str!("../../../../configs/qwen3.6-35b-a3b.json"))
                .expect("config parses");
        let n = 4096;
        let (mut mixer_r, mut moe_r) = (Region { base: 0, used: 0 }, Region { base: 0, used: 0 });
        let mixer = MixerScratch::carve(&c, n, &mut mixer_r);
        let moe = MoeScratch::carve(&c, n, &mut moe_r);
        // Attention's queries over the DeltaNet pieces; the projection and output apart.
        assert_eq!(mixer.q, mixer.gdn_act);
        assert!(mixer.proj < mixer.core && mixer.core < mixer.q);
        assert!(mixer.gdn_act < mixer.gdn_values);
        // The experts' down rows over their gate and up rows, after everything the down product
        // reads; the decode kernels' activations over the grouped pieces.
        assert_eq!(moe.down_rows, moe.gate_rows);
        assert!(moe.act16 < moe.gate_rows && moe.actscale < moe.gate_rows);
        assert!(moe.gate_rows < moe.up_rows);
        assert_eq!(moe.act, moe.order);
        let down_end = moe.down_rows as usize + n * c.num_experts_per_tok * c.hidden_size * 4;
        assert!(down_end <= moe_r.used);
        // The layer's storage is the larger phase: under 160 KB per token at full size, where
        // separate buffers took 290 KB.
        let bytes = mixer_r.after(moe_r).used;
        assert_eq!(bytes, mixer_r.used.max(moe_r.used));
        assert!(bytes < 160 * 1024 * n, "{bytes}");
    }
}

//! Prefill: a prompt goes through the model a chunk of tokens at a time, layer by layer over the
//! whole chunk. Projections with 4- and 8-bit weights run on tensor cores for the chunk at once
//! (gemm.rs), the MoE grouped by expert; attention is causal flash attention on tensor cores
//! (`attention_prefill`); the DeltaNet recurrence runs in its chunkwise form (64-token
//! sub-chunks as matrix products on tensor cores, the state carried from one to the next). Other
//! weight formats run the decode kernels with the chunk's tokens along a grid dimension. Scratch
//! is sized for one chunk, so a prompt of any length fits.

use anyhow::{Context, Result, ensure};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::gemm::{GEMM_GROUP_TOKENS, GEMM_ROWS, GEMM_THREADS, gemm_smem_bytes, on_tensor_cores};
use super::timing::PrefillPart;
use super::weights::{DeviceMixer, DeviceWeight, ptr};
use super::{
    AttentionBuffers, AttentionDims, CudaBackend, CudaState, DeltaNetDims, DeltaNetParams,
    DeltaNetShape, MoeBuffers, MoeDims, arg, cfg,
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
/// Assignments per tile of the grouped MoE product (GROUP_TILE in moe.cu): one block's tokens.
const GROUP_TILE: usize = GEMM_GROUP_TOKENS;
/// Tokens per sub-chunk of the chunkwise DeltaNet recurrence (GDN_CHUNK in deltanet.cu). Its
/// scratch holds whole sub-chunks.
const GDN_CHUNK: usize = 64;
/// Row stride of the state, U and V' tiles in `deltanet_chunk_state`'s shared memory
/// (GDN_STATE_STRIDE).
const GDN_STATE_STRIDE: usize = 40;
/// Row stride of the 64 x 64 token tiles in the chunkwise kernels' shared memory (GDN_A_STRIDE).
const GDN_A_STRIDE: usize = 68;

/// Activations of one prefill chunk, row per token.
pub(super) struct PrefillScratch {
    tokens: CudaSlice<i32>,
    x: CudaSlice<f32>,
    proj: CudaSlice<f32>,
    core: CudaSlice<f32>,
    q: CudaSlice<f32>,
    router_logits: CudaSlice<f32>,
    act: CudaSlice<f32>,
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    /// Inputs of a tensor-core product in fp16, and each token's power-of-two scale.
    x16: CudaSlice<u16>,
    xscale: CudaSlice<f32>,
    /// Grouped MoE: assignments (token * top_k + slot) sorted by expert, the expert tiles over
    /// them and their count, each assignment's gate and up rows, its activation in fp16 (and
    /// scale), and its down row.
    order: CudaSlice<i32>,
    tiles: CudaSlice<i32>,
    tile_count: CudaSlice<i32>,
    gate_rows: CudaSlice<f32>,
    up_rows: CudaSlice<f32>,
    act16: CudaSlice<u16>,
    actscale: CudaSlice<f32>,
    down_rows: CudaSlice<f32>,
    /// DeltaNet: the convolved, activated q|k|v of every token, its (beta, log decay) per value
    /// head, and the recurrence's output before the gated norm.
    gdn_act: CudaSlice<f32>,
    gdn_gates: CudaSlice<f32>,
    gdn_raw: CudaSlice<f32>,
    /// Chunkwise DeltaNet, per token and value head: the log decay summed from its sub-chunk's
    /// start (in fp64), W (key_dim floats) and U, which deltanet_chunk_state turns into V' in place
    /// (value_dim floats).
    gdn_gcum: CudaSlice<f64>,
    gdn_w: CudaSlice<f32>,
    gdn_values: CudaSlice<f32>,
}

/// Most tiles of GROUP_TILE assignments the experts' runs of a chunk can make.
fn max_group_tiles(c: &crate::config::ModelConfig, chunk: usize) -> usize {
    (chunk * c.num_experts_per_tok).div_ceil(GROUP_TILE) + c.num_experts
}

impl PrefillScratch {
    pub(super) fn new(stream: &Arc<CudaStream>, b: &CudaBackend) -> Result<Self> {
        let c = &b.config;
        let n = b.prefill_chunk;
        // The chunkwise DeltaNet kernels write whole sub-chunks.
        let whole_sub_chunks = n.div_ceil(GDN_CHUNK) * GDN_CHUNK;
        let heads_hd = c.num_attention_heads * c.head_dim;
        let proj = (c.linear_conv_dim() + c.linear_value_dim() + 2 * c.linear_num_value_heads)
            .max(2 * heads_hd + 2 * c.num_key_value_heads * c.head_dim);
        let widest = c
            .hidden_size
            .max(c.linear_value_dim())
            .max(heads_hd)
            .max(c.moe_intermediate_size)
            .max(c.shared_expert_intermediate_size);
        let inter = c
            .moe_intermediate_size
            .max(c.shared_expert_intermediate_size);
        let slots = c.num_experts_per_tok + 1;
        let z = |len: usize| stream.alloc_zeros::<f32>(len.max(1));
        Ok(Self {
            tokens: stream.alloc_zeros::<i32>(n)?,
            x: z(n * c.hidden_size)?,
            proj: z(n * proj)?,
            core: z(n * c.linear_value_dim().max(heads_hd))?,
            q: z(n * heads_hd)?,
            router_logits: z(n * (c.num_experts + 1))?,
            act: z(n * slots * inter)?,
            ids: stream.alloc_zeros::<i32>(n * slots)?,
            weights: z(n * slots)?,
            x16: stream.alloc_zeros::<u16>(n * widest)?,
            xscale: z(n)?,
            order: stream.alloc_zeros::<i32>(n * c.num_experts_per_tok)?,
            tiles: stream.alloc_zeros::<i32>(3 * max_group_tiles(c, n))?,
            tile_count: stream.alloc_zeros::<i32>(1)?,
            gate_rows: z(n * c.num_experts_per_tok * inter)?,
            up_rows: z(n * c.num_experts_per_tok * inter)?,
            act16: stream.alloc_zeros::<u16>(n * c.num_experts_per_tok * inter)?,
            actscale: z(n * c.num_experts_per_tok)?,
            down_rows: z(n * c.num_experts_per_tok * c.hidden_size)?,
            gdn_act: z(n * c.linear_conv_dim())?,
            gdn_gates: z(n * 2 * c.linear_num_value_heads)?,
            gdn_raw: z(n * c.linear_value_dim())?,
            gdn_gcum: stream.alloc_zeros::<f64>(n * c.linear_num_value_heads)?,
            gdn_w: z(whole_sub_chunks * c.linear_num_value_heads * c.linear_key_head_dim)?,
            gdn_values: z(whole_sub_chunks * c.linear_value_dim())?,
        })
    }
}

impl CudaBackend {
    /// Runs `tokens` (at most the prefill chunk) from the state's position and returns the logits of
    /// every token (`LogitsFor::All`) or of the last.
    pub(super) fn prefill_chunk(
        &self,
        state: &mut CudaState,
        tokens: &[u32],
        which: LogitsFor,
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
        if guard.is_none() {
            *guard = Some(PrefillScratch::new(&self.stream, self)?);
        }
        let ps = guard.as_mut().context("prefill scratch allocated above")?;
        let slots = self
            .slots
            .lock()
            .map_err(|_| anyhow::anyhow!("slot lock poisoned"))?;
        let slot = &slots[state.slot];
        let s = &self.stream;
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        s.memcpy_htod(&ids, &mut ps.tokens)?;

        let m = &self.model;
        let p = |x: &CudaSlice<f32>| ptr(x, s);
        let (x, proj, core) = (p(&ps.x), p(&ps.proj), p(&ps.core));
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
                &mut [arg(&embed), arg(&token_ids), arg(&x)],
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
                    let conv = p(&slot.conv[gdn_i]);
                    let params = DeltaNetParams {
                        dims: &gdn_dims,
                        proj,
                        conv,
                        conv_w: p(conv_w),
                        a_log: p(a_log),
                        dt_bias: p(dt_bias),
                        norm: p(norm),
                        state: p(&slot.recurrent[gdn_i]),
                        position,
                        out: core,
                    };
                    if scan_fits(c) {
                        self.deltanet_prefill(ps, &params, n)?;
                    } else {
                        self.deltanet_step(&params, n)?;
                    }
                    if n > 1 {
                        let entries = n.min(c.linear_conv_kernel_dim) * c.linear_conv_dim();
                        // SAFETY: the ring holds kernel rows of conv_dim floats.
                        unsafe {
                            self.launch(
                                "deltanet_conv_ring",
                                &self.k.deltanet_conv_ring,
                                cfg(entries.div_ceil(256).min(1024) as u32, 1, 256, 0),
                                &mut [
                                    arg(&gdn_dims),
                                    arg(&proj),
                                    arg(&conv),
                                    arg(&position),
                                    arg(&n32),
                                ],
                            )
                        }?;
                    }
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
                    let attn = AttentionBuffers {
                        proj,
                        q_norm: p(q_norm),
                        k_norm: p(k_norm),
                        position,
                        q: p(&ps.q),
                        k_cache: ptr(&slot.kv[attn_i].0, s),
                        v_cache: ptr(&slot.kv[attn_i].1, s),
                        out: core,
                    };
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
                &mut [arg(&position), arg(&by)],
            )
        }?;
        state.position += n;
        state.device_token = None;
        self.mark(PrefillPart::Projections)?;

        let final_norm = Some(p(&m.final_norm));
        match which {
            LogitsFor::All => {
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
            LogitsFor::Last => {
                let last = x + ((n - 1) * c.hidden_size * 4) as u64;
                let out = p(&self.scratch.logits);
                self.project(ps, &m.lm_head, last, final_norm, out, false, 1)?;
                self.mark(PrefillPart::LmHead)?;
                Ok(s.clone_dtoh(&self.scratch.logits)?)
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
        let s = &self.stream;
        // A few rows (the last position's logits, short prompts) read the weights once either
        // way, and the mat-vec reads them at full bandwidth without padding the token tile.
        if on_tensor_cores(w) && n > MATVEC_MAX_TOKENS {
            let (x16, xs) = (ptr(&ps.x16, s), ptr(&ps.xscale, s));
            self.rows_to_half(x, w.cols, norm, w.bits, n, x16, xs)?;
            self.gemm_rows(w, x16, xs, n, y, accumulate)?;
        } else {
            let (desc, norm) = (w.desc(s), norm.unwrap_or(0));
            let (eps, acc) = (self.config.rms_norm_eps, accumulate as i32);
            let mut launch = self.matvec_cfg(w);
            launch.grid_dim.1 = n as u32;
            // SAFETY: x and y hold n rows of w.cols and w.rows floats.
            unsafe {
                self.launch(
                    "matvec",
                    &self.k.matvec,
                    launch,
                    &mut [
                        arg(&desc),
                        arg(&x),
                        arg(&norm),
                        arg(&eps),
                        arg(&y),
                        arg(&acc),
                    ],
                )
            }?;
        }
        Ok(())
    }

    /// The MoE block of a layer for `n` token rows of the residual `x`, added to it.
    fn moe_chunk(
        &self,
        ps: &PrefillScratch,
        layer: &super::weights::DeviceLayer,
        x: u64,
        n: usize,
    ) -> Result<()> {
        let experts = [&layer.gate, &layer.up, &layer.down];
        let shared = [&layer.shared_gate, &layer.shared_up, &layer.shared_down];
        // One fp16 copy of the normed input serves the gate and up products of all experts, so
        // they must share a width (its permutation).
        let bits = layer.gate.bits;
        if experts
            .iter()
            .chain(&shared)
            .all(|w| on_tensor_cores(w) && w.bits == bits)
        {
            self.moe_chunk_grouped(ps, layer, x, n)
        } else {
            let s = &self.stream;
            let buffers = MoeBuffers {
                router_logits: ptr(&ps.router_logits, s),
                act: ptr(&ps.act, s),
                ids: ptr(&ps.ids, s),
                weights: ptr(&ps.weights, s),
            };
            self.moe(layer, &buffers, x, n)
        }
    }

    /// The MoE block with the chunk's tokens grouped by expert: every expert's weights are read
    /// once per chunk and multiplied by all its tokens on tensor cores.
    fn moe_chunk_grouped(
        &self,
        ps: &PrefillScratch,
        layer: &super::weights::DeviceLayer,
        x: u64,
        n: usize,
    ) -> Result<()> {
        let (c, s) = (&self.config, &self.stream);
        let p = |b: &CudaSlice<f32>| ptr(b, s);
        let post = p(&layer.post_norm);
        let router = p(&ps.router_logits);
        // Router first: a 4-bit router would reuse x16, which then holds the normed input.
        self.project(ps, &layer.router, x, Some(post), router, false, n)?;
        let dims = MoeDims::new(c);
        let (ids, weights) = (ptr(&ps.ids, s), p(&ps.weights));
        // SAFETY: router_logits, ids and weights hold n rows.
        unsafe {
            self.launch(
                "moe_route",
                &self.k.moe_route,
                cfg(n as u32, 1, 32, 0),
                &mut [arg(&dims), arg(&router), arg(&ids), arg(&weights)],
            )
        }?;
        let (order, tiles, tile_count) =
            (ptr(&ps.order, s), ptr(&ps.tiles, s), ptr(&ps.tile_count, s));
        let n32 = n as i32;
        // SAFETY: order holds n * top_k entries, tiles max_group_tiles triples.
        unsafe {
            self.launch(
                "moe_group",
                &self.k.moe_group,
                cfg(1, 1, 1024, 0),
                &mut [
                    arg(&dims),
                    arg(&ids),
                    arg(&n32),
                    arg(&order),
                    arg(&tiles),
                    arg(&tile_count),
                ],
            )
        }?;
        // The normed input of every expert, shared included, in fp16.
        let (x16, xs) = (ptr(&ps.x16, s), p(&ps.xscale));
        self.rows_to_half(x, c.hidden_size, Some(post), layer.gate.bits, n, x16, xs)?;
        let (gate_rows, up_rows, down_rows) = (p(&ps.gate_rows), p(&ps.up_rows), p(&ps.down_rows));
        let (act16, actscale) = (ptr(&ps.act16, s), p(&ps.actscale));
        let top_k = c.num_experts_per_tok as i32;
        let tiles_max = max_group_tiles(c, self.prefill_chunk) as u32;
        // One launch for one or two stacked expert matrices with the same rows and inputs (gate
        // and up: grid.z picks the matrix).
        let grouped = |w: [&DeviceWeight; 2],
                       z: u32,
                       rows: usize,
                       x: (u64, u64),
                       in_div: i32,
                       y: [u64; 2]| {
            let (desc, desc2) = (w[0].desc(s), w[1].desc(s));
            let rows32 = rows as i32;
            let mut launch = cfg(
                tiles_max,
                rows.div_ceil(GEMM_ROWS) as u32,
                GEMM_THREADS,
                gemm_smem_bytes(w[0].bits, GEMM_GROUP_TOKENS),
            );
            launch.grid_dim.2 = z;
            // SAFETY: tiles and order come from moe_group; y holds a row per assignment.
            unsafe {
                self.launch(
                    "gemm_q_grouped",
                    &self.k.gemm_q_grouped,
                    launch,
                    &mut [
                        arg(&desc),
                        arg(&desc2),
                        arg(&rows32),
                        arg(&tiles),
                        arg(&tile_count),
                        arg(&order),
                        arg(&in_div),
                        arg(&x.0),
                        arg(&x.1),
                        arg(&y[0]),
                        arg(&y[1]),
                    ],
                )
            }
        };
        let inter = c.moe_intermediate_size;
        grouped(
            [&layer.gate, &layer.up],
            2,
            inter,
            (x16, xs),
            top_k,
            [gate_rows, up_rows],
        )?;
        self.swiglu(
            gate_rows,
            up_rows,
            weights,
            (top_k, top_k + 1, 0),
            (inter, layer.down.bits),
            n * c.num_experts_per_tok,
            act16,
            actscale,
        )?;
        grouped(
            [&layer.down, &layer.down],
            1,
            c.hidden_size,
            (act16, actscale),
            1,
            [down_rows, down_rows],
        )?;
        let hidden32 = c.hidden_size as i32;
        // SAFETY: down_rows holds n * top_k rows of hidden floats, x n rows.
        unsafe {
            self.launch(
                "add_expert_rows",
                &self.k.add_expert_rows,
                cfg(c.hidden_size.div_ceil(256) as u32, n as u32, 256, 0),
                &mut [arg(&down_rows), arg(&top_k), arg(&hidden32), arg(&x)],
            )
        }?;

        // The shared expert, dense over the chunk, weighted by its sigmoid gate.
        let shared_inter = c.shared_expert_intermediate_size;
        self.gemm_rows(&layer.shared_gate, x16, xs, n, gate_rows, false)?;
        self.gemm_rows(&layer.shared_up, x16, xs, n, up_rows, false)?;
        self.swiglu(
            gate_rows,
            up_rows,
            weights,
            (1, top_k + 1, top_k),
            (shared_inter, layer.shared_down.bits),
            n,
            act16,
            actscale,
        )?;
        self.gemm_rows(&layer.shared_down, act16, actscale, n, x, true)
    }

    /// act16 = silu(gate) * up * weight per row, in fp16 with a per-row scale, permuted for the
    /// `bits`-bit down projection (swiglu_to_half; `pick` = (per, stride, offset) finds each
    /// row's weight).
    #[allow(clippy::too_many_arguments)]
    fn swiglu(
        &self,
        gate: u64,
        up: u64,
        weights: u64,
        pick: (i32, i32, i32),
        (width, bits): (usize, usize),
        rows: usize,
        act16: u64,
        actscale: u64,
    ) -> Result<()> {
        let (per, stride, offset) = pick;
        let (width, bits) = (width as i32, bits as i32);
        // SAFETY: gate, up, act16 hold `rows` rows of `width`; weights covers every row's pick.
        unsafe {
            self.launch(
                "swiglu_to_half",
                &self.k.swiglu_to_half,
                cfg(rows as u32, 1, 256, 0),
                &mut [
                    arg(&gate),
                    arg(&up),
                    arg(&weights),
                    arg(&per),
                    arg(&stride),
                    arg(&offset),
                    arg(&width),
                    arg(&bits),
                    arg(&act16),
                    arg(&actscale),
                ],
            )
        }
    }
}

/// Dynamic shared memory of `attention_prefill`: its query, key and value tiles in bf16, rows of
/// head_dim rounded up to an instantiated width (32, 64, 128 or 256; construction checks that
/// head_dim is at most 256) plus 8 values of padding.
fn attention_prefill_smem(head_dim: usize) -> u32 {
    let width = [32, 64, 128, 256]
        .into_iter()
        .find(|&w| head_dim <= w)
        .unwrap_or(256);
    ((ATTENTION_QUERY_TILE + 2 * ATTENTION_KEY_TILE) * (width + 8) * 2) as u32
}

/// Whether `deltanet_scan` holds the model's heads: a lane keeps 4 of at most 128 key rows, a warp
/// 4 value columns.
fn scan_fits(c: &ModelConfig) -> bool {
    c.linear_key_head_dim <= 128
        && c.linear_key_head_dim.is_multiple_of(4)
        && c.linear_value_head_dim.is_multiple_of(4)
}

/// Whether the chunkwise kernels take the model's heads: key_dim and value_dim multiples of 16
/// (whole mma tiles, a multiple of 16 columns per state block) and at most 128 (a warp of the
/// state block per 16 state rows, a column of the forward substitution per thread). Implies
/// `scan_fits`.
fn chunked_fits(c: &ModelConfig) -> bool {
    let (kd, vd) = (c.linear_key_head_dim, c.linear_value_head_dim);
    kd <= 128 && vd <= 128 && kd.is_multiple_of(16) && vd.is_multiple_of(16)
}

impl CudaBackend {
    /// DeltaNet over a chunk: conv and norms in parallel over the tokens, the recurrence in the
    /// chunkwise form (`deltanet_chunkwise`) where it takes the heads, else in `deltanet_scan`, the
    /// gated norm in parallel again.
    fn deltanet_prefill(&self, ps: &PrefillScratch, l: &DeltaNetParams, n: usize) -> Result<()> {
        let (c, s) = (&self.config, &self.stream);
        let (act, gates, raw) = (
            ptr(&ps.gdn_act, s),
            ptr(&ps.gdn_gates, s),
            ptr(&ps.gdn_raw, s),
        );
        let whole_warps = |threads: usize| threads.div_ceil(32) as u32 * 32;
        let n32 = n as i32;
        // SAFETY (all launches in this function): the chunk buffers hold n rows of conv_dim
        // floats (act), value_heads gates and value_heads * value_dim outputs (raw, out); the
        // grids cover exactly the shapes the kernels document.
        unsafe {
            self.launch(
                "deltanet_conv_chunk",
                &self.k.deltanet_conv_chunk,
                cfg(c.linear_conv_dim().div_ceil(256) as u32, n as u32, 256, 0),
                &mut [
                    arg(l.dims),
                    arg(&l.proj),
                    arg(&l.conv),
                    arg(&l.conv_w),
                    arg(&l.position),
                    arg(&act),
                ],
            )?;
            self.launch(
                "deltanet_norm_chunk",
                &self.k.deltanet_norm_chunk,
                cfg(
                    c.linear_num_key_heads as u32,
                    n as u32,
                    whole_warps(c.linear_key_head_dim),
                    0,
                ),
                &mut [
                    arg(l.dims),
                    arg(&l.proj),
                    arg(&l.a_log),
                    arg(&l.dt_bias),
                    arg(&act),
                    arg(&gates),
                ],
            )?;
        }
        if chunked_fits(c) {
            self.deltanet_chunkwise(ps, l, n)?;
        } else {
            let warps = c.linear_value_dim() / 4;
            // SAFETY: as above; the state holds value_heads * key_dim * value_dim floats.
            unsafe {
                self.launch(
                    "deltanet_scan",
                    &self.k.deltanet_scan,
                    cfg(warps.div_ceil(8) as u32, 1, 256, 0),
                    &mut [
                        arg(l.dims),
                        arg(&act),
                        arg(&gates),
                        arg(&l.state),
                        arg(&n32),
                        arg(&raw),
                    ],
                )
            }?;
        }
        // SAFETY: as above.
        unsafe {
            self.launch(
                "deltanet_gated_norm",
                &self.k.deltanet_gated_norm,
                cfg(
                    c.linear_num_value_heads as u32,
                    n as u32,
                    whole_warps(c.linear_value_head_dim),
                    0,
                ),
                &mut [
                    arg(l.dims),
                    arg(&raw),
                    arg(&l.proj),
                    arg(&l.norm),
                    arg(&l.out),
                ],
            )?;
        }
        Ok(())
    }

    /// The chunkwise recurrence over the `n` tokens in act and gates (see deltanet.cu): W, U and
    /// the cumulative decays per (value head, sub-chunk) in parallel, the state through the
    /// sub-chunks in order per (value head, 32 value columns, or 16 where value_dim is not a
    /// multiple of 32: gdn_state_cols in deltanet.cu), then the intra-sub-chunk part of
    /// the output per (value head, sub-chunk) in parallel again. Writes raw and the final state.
    fn deltanet_chunkwise(&self, ps: &PrefillScratch, l: &DeltaNetParams, n: usize) -> Result<()> {
        let (c, s) = (&self.config, &self.stream);
        let p = |b: &CudaSlice<f32>| ptr(b, s);
        let (act, gates, raw) = (p(&ps.gdn_act), p(&ps.gdn_gates), p(&ps.gdn_raw));
        let (gcum, w, values) = (ptr(&ps.gdn_gcum, s), p(&ps.gdn_w), p(&ps.gdn_values));
        let (heads, kd, vd) = (
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        );
        let sub_chunks = n.div_ceil(GDN_CHUNK) as u32;
        let n32 = n as i32;
        let prepare_smem =
            (GDN_CHUNK * (kd + 4 + vd) + GDN_CHUNK * GDN_A_STRIDE + 4 * GDN_CHUNK) * 4;
        let state_smem =
            (GDN_CHUNK * (3 * kd + 16) + (2 * GDN_CHUNK + kd) * GDN_STATE_STRIDE + 2 * GDN_CHUNK)
                * 4;
        let output_smem = ((2 * GDN_CHUNK * (kd + 4)).max(GDN_CHUNK * (vd + 8))
            + GDN_CHUNK * GDN_A_STRIDE
            + 2 * GDN_CHUNK)
            * 4;
        let state_cols = if vd.is_multiple_of(32) { 32 } else { 16 };
        let state_blocks = heads * vd / state_cols;
        // SAFETY (all three): act holds n rows of conv_dim floats, gates n rows of value_heads
        // float pairs, gcum n rows of value_heads doubles, w and values the chunk's rows rounded
        // up to whole sub-chunks (the kernels write the missing tokens' rows of the last one) of
        // value_heads * key_dim and value_heads * value_dim floats, raw n rows of value_heads *
        // value_dim, the state value_heads * key_dim * value_dim; chunked_fits holds, and the
        // dynamic shared memory is what the kernels document (at key_dim = value_dim = 128: 83,
        // 141 and 84 KiB, under MAX_DYNAMIC_SHARED_BYTES).
        unsafe {
            self.launch(
                "deltanet_chunk_prepare",
                &self.k.deltanet_chunk_prepare,
                cfg(heads as u32, sub_chunks, 256, prepare_smem as u32),
                &mut [
                    arg(l.dims),
                    arg(&act),
                    arg(&gates),
                    arg(&n32),
                    arg(&gcum),
                    arg(&w),
                    arg(&values),
                ],
            )?;
            self.launch(
                "deltanet_chunk_state",
                &self.k.deltanet_chunk_state,
                cfg(state_blocks as u32, 1, 256, state_smem as u32),
                &mut [
                    arg(l.dims),
                    arg(&act),
                    arg(&gcum),
                    arg(&w),
                    arg(&values),
                    arg(&l.state),
                    arg(&n32),
                    arg(&raw),
                ],
            )?;
            self.launch(
                "deltanet_chunk_output",
                &self.k.deltanet_chunk_output,
                cfg(heads as u32, sub_chunks, 256, output_smem as u32),
                &mut [
                    arg(l.dims),
                    arg(&act),
                    arg(&gcum),
                    arg(&values),
                    arg(&n32),
                    arg(&raw),
                ],
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::MAX_DYNAMIC_SHARED_BYTES;
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
}

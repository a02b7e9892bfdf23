//! The decode step: what one token's pass through the model launches, recorded once per
//! sequence slot, or once per batch size for batched steps (a token of each of several
//! sequences, a grid row each, their buffers looked up in the batch tables), and replayed as a
//! CUDA graph. Its layer parts (the DeltaNet step, attention through the context splits, the
//! MoE kernels) also serve prefill for weights the tensor-core products do not take, with the
//! chunk's tokens along a grid dimension; the other way round, a large batch's routed experts
//! take prefill's grouped products (each expert's weights read once for all its tokens).

use anyhow::{Context, Result, ensure};
use cudarc::driver::{CudaSlice, CudaStream};

use super::gemm::on_tensor_cores;
use super::prefill::GroupedExperts;
use super::shapes::{
    ARGMAX_BLOCKS, ATTENTION_SPLITS, ATTENTION_WARPS, AttentionDims, COMBINE_DIMS, COMBINE_PARTS,
    DOWN_ROWS_PER_WARP, DeltaNetDims, DeltaNetShape, FOLD_ROWS, GATE_UP_ROWS_PER_WARP,
    MATVEC_BLOCKS_PER_SM, MATVEC_THREADS, MoeDims, SAMPLE_SCAN_THREADS, SAMPLE_THREADS,
    attention_split_blocks_per_split, attention_split_smem, gate_up_row_blocks, gate_up_warps,
    mma_takes, moe_down_staged_bytes, moe_slot_width, moe_stages_act, moe_token_blocks,
    sample_slices, shared_slice_bytes, staged_bytes, staged_floats_bits,
};
use super::weights::{self, DeviceMixer, FoldDesc, RouterFold, ptr};
use super::{
    AttentionBuffers, AttentionSeqs, AttentionSplits, BatchTables, CudaBackend, DeltaNetParams,
    MmaRows, MoeBuffers, NO_BATCH_CONTEXT, ONE_TOKEN, Slot, StepEnd, arg, cfg,
};

/// Sequences from which a batched decode step's routed experts take prefill's grouped
/// products (each expert's weights read once for all its tokens) instead of the decode
/// kernels (each token's experts read for it).
const GROUPED_DECODE_MIN_TOKENS: usize = 16;

/// Whose tokens a recorded decode step carries.
#[derive(Clone, Copy)]
pub(super) enum StepSeqs<'a> {
    /// One slot's: its buffers are the launches' arguments.
    Slot(&'a Slot),
    /// The sequences of the first `rows` rows of the batch tables, a grid row each: the kernels
    /// look their buffers up in the tables.
    Batch(&'a BatchTables, usize),
}

impl StepSeqs<'_> {
    fn rows(&self) -> usize {
        match self {
            Self::Slot(_) => 1,
            Self::Batch(_, rows) => *rows,
        }
    }

    /// The slot's own buffer (`own`) and no table, or no buffer of its own (0) and the batch
    /// tables' column `field` (see `seq_buffer` in common.cuh).
    pub(super) fn buffer(
        &self,
        own: impl FnOnce(&Slot) -> u64,
        field: impl FnOnce(&BatchTables) -> usize,
        s: &CudaStream,
    ) -> (u64, u64) {
        match self {
            Self::Slot(slot) => (own(slot), 0),
            Self::Batch(tables, _) => (0, tables.column(field(tables), s)),
        }
    }
}

/// A layer's router folded into its mixer's output projection (`out_proj_route` in moe.cu):
/// the fold, and what it multiplies: the mixer's output `core` and the residual stream
/// `before` the projection was added.
pub(super) struct FoldedRouter<'a> {
    fold: &'a RouterFold,
    core: u64,
    before: u64,
}

impl CudaBackend {
    /// Issues one decode step for `seqs` on the stream (for capture into a graph).
    pub(super) fn record_step(&self, seqs: StepSeqs, end: StepEnd) -> Result<()> {
        let (c, s, sc, m) = (&self.config, &self.stream, &self.scratch, &self.model);
        let p = |x: &CudaSlice<f32>| ptr(x, s);
        let (x, proj, core) = (p(&sc.x), p(&sc.proj), p(&sc.core));
        let rows = seqs.rows();
        let (position, position_of) =
            seqs.buffer(|slot| ptr(&slot.position, s), |_| BatchTables::POSITION, s);
        let (token, token_of) = seqs.buffer(|slot| ptr(&slot.token, s), |_| BatchTables::TOKEN, s);

        // A batch whose projections take the tensor-core product shares attention's context
        // splits among its sequences, by the sum of their lengths that `embed` writes.
        let batch_context = match seqs {
            StepSeqs::Batch(..) if self.step_shares_attention_splits(rows) => {
                ptr(&sc.batch_context, s)
            }
            _ => NO_BATCH_CONTEXT,
        };
        let embed = m.embed.desc(s);
        // SAFETY: x holds a row of hidden_size floats per sequence; the tokens are checked on
        // the host; batch_context (when not 0) is one int.
        unsafe {
            self.launch(
                "embed",
                &self.k.embed,
                cfg(c.hidden_size.div_ceil(256) as u32, rows as u32, 256, 0),
                &mut [
                    arg(&embed),
                    arg(&token),
                    arg(&x),
                    arg(&token_of),
                    arg(&position_of),
                    arg(&batch_context),
                ],
            )
        }?;

        let gdn = DeltaNetShape::of(c).context("DeltaNet shape checked at construction")?;
        let gdn_dims = DeltaNetDims::new(c, gdn.splits);
        let attn_dims = AttentionDims::new(c, self.max_context, self.attention_splits);
        let moe_buffers = MoeBuffers {
            router_logits: p(&sc.router_logits),
            act: p(&sc.act),
            ids: ptr(&sc.ids, s),
            weights: p(&sc.weights),
            routed_staged: p(&sc.routed_staged),
            routing_ready: ptr(&sc.routing_ready, s),
        };

        // A large batch's routed experts take prefill's grouped products, in its scratch.
        let grouped = (self.groups_decode_experts(rows) && matches!(seqs, StepSeqs::Batch(..)))
            .then_some(&self.grouped_experts);

        // The layers whose router is folded into the mixer's output projection write the
        // residual stream from one buffer to the other there (see `mixer_output`).
        let (mut x, mut x_spare) = (x, p(&sc.x_next));
        let (mut attn_i, mut gdn_i) = (0, 0);
        for layer in &m.layers {
            let fold = layer.router_fold.as_ref();
            // The residual stream before the mixer's output is added (the folded router's input).
            let before = x;
            match &layer.mixer {
                DeviceMixer::DeltaNet {
                    in_proj,
                    out_proj,
                    conv_w,
                    a_log,
                    dt_bias,
                    norm,
                } => {
                    self.matvec(
                        "in_proj",
                        in_proj,
                        x,
                        Some(p(&layer.input_norm)),
                        proj,
                        None,
                        rows,
                    )?;
                    let weights = [conv_w, a_log, dt_bias, norm];
                    let gdn_layer =
                        DeltaNetParams::new(&gdn_dims, weights, seqs, gdn_i, proj, core, s);
                    self.deltanet_step(&gdn_layer, 1, rows)?;
                    let roles = ("out_proj", "out_proj_route");
                    let stream = (&mut x, &mut x_spare);
                    self.mixer_output(roles, out_proj, fold, core, stream, &moe_buffers, rows)?;
                    gdn_i += 1;
                }
                DeviceMixer::Attention {
                    qkv,
                    o_proj,
                    q_norm,
                    k_norm,
                } => {
                    self.matvec("qkv", qkv, x, Some(p(&layer.input_norm)), proj, None, rows)?;
                    let norms = [q_norm, k_norm];
                    let q = p(&sc.q);
                    let mut attn = AttentionBuffers::new(norms, seqs, attn_i, proj, q, core, s);
                    attn.seqs.batch_context = batch_context;
                    let splits = AttentionSplits {
                        max: p(&sc.part_max),
                        sum: p(&sc.part_sum),
                        out: p(&sc.part_out),
                    };
                    self.attention(&attn_dims, &attn, &splits, rows)?;
                    let roles = ("o_proj", "o_proj_route");
                    let stream = (&mut x, &mut x_spare);
                    self.mixer_output(roles, o_proj, fold, core, stream, &moe_buffers, rows)?;
                    attn_i += 1;
                }
            }
            let folded = fold.map(|fold| FoldedRouter { fold, core, before });
            self.moe(layer, &moe_buffers, x, rows, grouped, folded)?;
        }
        let logits = p(&sc.logits);
        self.matvec(
            "lm_head",
            &m.lm_head,
            x,
            Some(p(&m.final_norm)),
            logits,
            None,
            rows,
        )?;
        let n = c.vocab_size as i32;
        // One slot's step tells the host its id through the slot's mapped word; a batch's
        // are read back from `chosen`.
        let (chosen, announce) = match seqs {
            StepSeqs::Slot(slot) => (0, slot.announce.device_address()),
            StepSeqs::Batch(..) => (ptr(&sc.chosen, s), 0),
        };
        match end {
            StepEnd::Greedy => {
                let (av, ai) = (p(&sc.arg_val), ptr(&sc.arg_idx, s));
                // SAFETY: partial buffers hold ARGMAX_BLOCKS entries per row.
                unsafe {
                    self.launch(
                        "argmax_partial",
                        &self.k.argmax_partial,
                        cfg(ARGMAX_BLOCKS as u32, rows as u32, 256, 0),
                        &mut [arg(&logits), arg(&n), arg(&av), arg(&ai)],
                    )
                }?;
                let parts = ARGMAX_BLOCKS as i32;
                // SAFETY: one warp over each row's partials; chosen holds a row each; announce
                // (when not 0) is the slot's mapped 8-byte word.
                unsafe {
                    self.launch(
                        "argmax_final",
                        &self.k.argmax_final,
                        cfg(1, rows as u32, 32, 0),
                        &mut [
                            arg(&av),
                            arg(&ai),
                            arg(&parts),
                            arg(&token),
                            arg(&position),
                            arg(&token_of),
                            arg(&position_of),
                            arg(&chosen),
                            arg(&announce),
                        ],
                    )
                }?;
            }
            StepEnd::Sampled => {
                let (desc, desc_of) =
                    seqs.buffer(|slot| ptr(&slot.sampling, s), |_| BatchTables::SAMPLING, s);
                let (history, history_of) =
                    seqs.buffer(|slot| ptr(&slot.history, s), |_| BatchTables::HISTORY, s);
                let (slice, blocks) =
                    sample_slices(c.vocab_size).context("vocabulary too large to sample")?;
                let parts = sc.sample_parts(s);
                let slice_arg = slice as i32;
                // SAFETY: `blocks` blocks of at most `slice` logits (as many 4-byte keys of shared
                // memory) per row, within the SAMPLE_MAX_BLOCKS entries per row of the parts; a
                // slot's history holds a word per id of the vocabulary.
                unsafe {
                    self.launch(
                        "sample_scan",
                        &self.k.sample_scan,
                        cfg(
                            blocks as u32,
                            rows as u32,
                            SAMPLE_SCAN_THREADS,
                            (slice * size_of::<f32>()) as u32,
                        ),
                        &mut [
                            arg(&logits),
                            arg(&n),
                            arg(&slice_arg),
                            arg(&desc),
                            arg(&desc_of),
                            arg(&history),
                            arg(&history_of),
                            arg(&parts),
                        ],
                    )
                }?;
                let blocks_arg = blocks as i32;
                // SAFETY: one block over each row's partials; desc is the slot's settings, the
                // history a word per id of the vocabulary; announce (when not 0) is the slot's
                // mapped 8-byte word.
                unsafe {
                    self.launch(
                        "sample_finish",
                        &self.k.sample_finish,
                        cfg(1, rows as u32, SAMPLE_THREADS, 0),
                        &mut [
                            arg(&logits),
                            arg(&n),
                            arg(&blocks_arg),
                            arg(&slice_arg),
                            arg(&desc),
                            arg(&token),
                            arg(&position),
                            arg(&desc_of),
                            arg(&token_of),
                            arg(&position_of),
                            arg(&history),
                            arg(&history_of),
                            arg(&chosen),
                            arg(&parts),
                            arg(&announce),
                        ],
                    )
                }?;
            }
            StepEnd::Logits => {
                // SAFETY: one thread per row increments its sequence's position.
                unsafe {
                    self.launch(
                        "advance_position",
                        &self.k.advance_position,
                        cfg(1, rows as u32, 1, 0),
                        &mut [arg(&position), arg(&ONE_TOKEN), arg(&position_of)],
                    )
                }?;
            }
        }
        Ok(())
    }

    /// One DeltaNet layer's recurrence for `tokens` tokens with `deltanet_step` (conv, norms,
    /// gates, state update and gated norm, token by token inside the kernel), for each of `rows`
    /// sequences of a batch (one token each) or for the one sequence of `l`.
    pub(super) fn deltanet_step(
        &self,
        l: &DeltaNetParams,
        tokens: usize,
        rows: usize,
    ) -> Result<()> {
        let c = &self.config;
        let gdn = DeltaNetShape::of(c).context("DeltaNet shape checked at construction")?;
        let tokens = tokens as i32;
        let mut launch = cfg(
            (c.linear_num_value_heads * gdn.splits) as u32,
            1,
            gdn.threads as u32,
            gdn.smem as u32,
        );
        launch.grid_dim.2 = rows as u32;
        // Several sequences' blocks run in waves: the variant capped at four blocks per SM.
        let kernel = if rows > 1 {
            &self.k.deltanet_step_batched
        } else {
            &self.k.deltanet_step
        };
        // SAFETY: shapes checked at construction; proj and out hold a row per token (or
        // sequence); the grid is whole clusters.
        unsafe {
            self.launch_clusters(
                "deltanet_step",
                kernel,
                launch,
                gdn.splits as u32,
                &mut [
                    arg(l.dims),
                    arg(&l.proj),
                    arg(&l.conv),
                    arg(&l.conv_w),
                    arg(&l.a_log),
                    arg(&l.dt_bias),
                    arg(&l.norm),
                    arg(&l.state),
                    arg(&l.position),
                    arg(&tokens),
                    arg(&l.out),
                    arg(&l.seqs),
                ],
            )
        }?;
        Ok(())
    }

    /// q/k norms, RoPE and the cache append for `tokens` tokens at consecutive positions.
    pub(super) fn attention_prepare(
        &self,
        dims: &AttentionDims,
        b: &AttentionBuffers,
        tokens: usize,
    ) -> Result<()> {
        let c = &self.config;
        let blocks = (c.num_attention_heads + c.num_key_value_heads) as u32;
        // SAFETY: the host checks every position against max_context; q and proj hold a row per
        // token.
        unsafe {
            self.launch(
                "attention_prepare",
                &self.k.attention_prepare,
                cfg(
                    blocks,
                    tokens as u32,
                    c.head_dim as u32,
                    (c.head_dim * 4) as u32,
                ),
                &mut [
                    arg(dims),
                    arg(&b.proj),
                    arg(&b.q_norm),
                    arg(&b.k_norm),
                    arg(&b.position),
                    arg(&b.q),
                    arg(&b.k_cache),
                    arg(&b.v_cache),
                    arg(&b.seqs),
                ],
            )
        }
    }

    /// One attention layer for `tokens` tokens at consecutive positions through the decode
    /// kernels: attention_prepare, the context splits, their merge with the output gate.
    pub(super) fn attention(
        &self,
        dims: &AttentionDims,
        b: &AttentionBuffers,
        parts: &AttentionSplits,
        tokens: usize,
    ) -> Result<()> {
        self.attention_prepare(dims, b, tokens)?;
        self.attention_over_context(dims, b, parts, tokens)
    }

    /// Attention of the prepared queries over the cache (the context splits, then their merge
    /// with the output gate).
    fn attention_over_context(
        &self,
        dims: &AttentionDims,
        b: &AttentionBuffers,
        parts: &AttentionSplits,
        tokens: usize,
    ) -> Result<()> {
        let c = &self.config;
        let rows = tokens as i32;
        let tokens = tokens as u32;
        // SAFETY: q, proj and out hold a row per token, the split buffers tokens * heads *
        // dims.splits entries (of head_dim floats for `out`).
        unsafe {
            let mut split = cfg(
                attention_split_blocks_per_split(c) as u32,
                dims.splits as u32,
                (ATTENTION_WARPS * 32) as u32,
                attention_split_smem(c.head_dim),
            );
            // Tokens sharing the splits take them from one grid row of blocks.
            if b.seqs.batch_context == NO_BATCH_CONTEXT {
                split.grid_dim.2 = tokens;
                self.launch(
                    "attention_split",
                    &self.k.attention_split,
                    split,
                    &mut [
                        arg(dims),
                        arg(&b.q),
                        arg(&b.k_cache),
                        arg(&b.v_cache),
                        arg(&b.position),
                        arg(&parts.max),
                        arg(&parts.sum),
                        arg(&parts.out),
                        arg(&b.seqs),
                    ],
                )?;
            } else {
                self.launch(
                    "attention_split",
                    &self.k.attention_split_shared,
                    split,
                    &mut [
                        arg(dims),
                        arg(&b.q),
                        arg(&b.k_cache),
                        arg(&b.v_cache),
                        arg(&parts.max),
                        arg(&parts.sum),
                        arg(&parts.out),
                        arg(&b.seqs),
                        arg(&rows),
                    ],
                )?;
            }
            let mut combine = cfg(
                c.num_attention_heads as u32,
                c.head_dim.div_ceil(COMBINE_DIMS) as u32,
                (COMBINE_DIMS * COMBINE_PARTS) as u32,
                0,
            );
            combine.grid_dim.2 = tokens;
            self.launch(
                "attention_combine",
                &self.k.attention_combine,
                combine,
                &mut [
                    arg(dims),
                    arg(&b.proj),
                    arg(&b.position),
                    arg(&parts.max),
                    arg(&parts.sum),
                    arg(&parts.out),
                    arg(&b.out),
                    arg(&b.seqs.position),
                    arg(&b.seqs.batch_context),
                ],
            )?;
        }
        Ok(())
    }

    /// Decode attention of one query token (`q`: heads x head_dim, unscaled) over a cache of
    /// bf16 `keys` and `values` ([positions, kv_heads, head_dim], the last position the token's
    /// own), gated by sigmoid(`gate`) (heads x head_dim), with the context split at most
    /// `splits` ways: [heads, head_dim]. With `batch_context`, the token's splits are its share
    /// of them in a batch whose context lengths sum to that (see `step_shares_attention_splits`).
    /// Uploads everything, so it serves checks of the decode kernels at any context length and
    /// split count; decode runs them on the slot's buffers.
    pub fn attention_over_cache(
        &self,
        q: &[f32],
        keys: &[u16],
        values: &[u16],
        gate: &[f32],
        splits: usize,
        batch_context: Option<usize>,
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let (heads, hd) = (c.num_attention_heads, c.head_dim);
        let row = c.num_key_value_heads * hd;
        ensure!(
            q.len() == heads * hd && gate.len() == heads * hd,
            "q and gate hold {} and {} values, not heads x head_dim = {}",
            q.len(),
            gate.len(),
            heads * hd
        );
        ensure!(
            !keys.is_empty() && keys.len().is_multiple_of(row) && values.len() == keys.len(),
            "keys and values must hold the same whole number of rows of kv_heads x head_dim = {row}"
        );
        ensure!(
            (1..=ATTENTION_SPLITS).contains(&splits),
            "splits must be 1 to {ATTENTION_SPLITS}"
        );
        let positions = keys.len() / row;
        ensure!(
            batch_context.is_none_or(|n| (positions..=i32::MAX as usize).contains(&n)),
            "a batch's context holds at least the token's {positions} positions"
        );
        let s = &self.stream;
        // proj holds, per head, the query then the gate; only the gates are read.
        let mut proj = vec![0.0f32; heads * 2 * hd];
        for (h, g) in gate.chunks_exact(hd).enumerate() {
            proj[(2 * h + 1) * hd..(2 * h + 2) * hd].copy_from_slice(g);
        }
        let proj = s.clone_htod(&proj)?;
        let q = s.clone_htod(q)?;
        let (k_cache, v_cache) = (s.clone_htod(keys)?, s.clone_htod(values)?);
        let position = s.clone_htod(&[(positions - 1) as i32])?;
        let out = s.alloc_zeros::<f32>(heads * hd)?;
        let (max, sum) = (
            s.alloc_zeros::<f32>(heads * splits)?,
            s.alloc_zeros::<f32>(heads * splits)?,
        );
        let part_out = s.alloc_zeros::<f32>(heads * splits * hd)?;
        // A batch's tokens find their positions in its table (here a table of one).
        let context = s.clone_htod(&[batch_context.unwrap_or(0) as i32])?;
        let position_of = s.clone_htod(&[ptr(&position, s)])?;
        let dims = AttentionDims::new(c, positions, splits);
        let b = AttentionBuffers {
            proj: ptr(&proj, s),
            q_norm: 0,
            k_norm: 0,
            position: ptr(&position, s),
            q: ptr(&q, s),
            k_cache: ptr(&k_cache, s),
            v_cache: ptr(&v_cache, s),
            out: ptr(&out, s),
            seqs: match batch_context {
                Some(_) => AttentionSeqs {
                    position: ptr(&position_of, s),
                    batch_context: ptr(&context, s),
                    ..AttentionSeqs::default()
                },
                None => AttentionSeqs::default(),
            },
        };
        let parts = AttentionSplits {
            max: ptr(&max, s),
            sum: ptr(&sum, s),
            out: ptr(&part_out, s),
        };
        self.attention_over_context(&dims, &b, &parts, 1)?;
        Ok(s.clone_dtoh(&out)?)
    }

    /// Whether a batched step of `rows` sequences shares attention's context splits among its
    /// sequences in proportion to their lengths (about one wave of blocks in all) rather than
    /// giving each sequence a wave's worth of its own: where its projections take the
    /// tensor-core product, so that its results differ from each sequence's own step by
    /// rounding anyway. Its own splits would run in waves of short blocks (at 32 sequences of 4K
    /// context, 16 waves of blocks of 128 positions); shared ones let each block stream its part
    /// of the cache, and a long context among short ones still gets most of the splits.
    fn step_shares_attention_splits(&self, rows: usize) -> bool {
        self.model.layers.iter().any(|l| match &l.mixer {
            DeviceMixer::Attention { qkv, .. } => self.matvec_takes_mma(qkv, rows),
            DeviceMixer::DeltaNet { .. } => false,
        })
    }

    /// Whether a batched step of `rows` sequences sends its routed experts through prefill's
    /// grouped products (where the layer's expert weights allow: `experts_group`).
    fn groups_decode_experts(&self, rows: usize) -> bool {
        (GROUPED_DECODE_MIN_TOKENS..=self.prefill_chunk).contains(&rows)
    }

    /// The mixer's output projection `w` of `core`, added to the residual stream `stream.0`:
    /// in place (`roles.0`), or, where the layer's router is folded (`fold`), into the spare
    /// buffer `stream.1`, which then holds the stream (the two swapped), so that the folded
    /// router can still read the stream as it was: one token's `out_proj_route` (`roles.1`)
    /// computes the router's raw logits in the same launch, a batch's `moe_router_shared`
    /// after it.
    #[allow(clippy::too_many_arguments)]
    fn mixer_output(
        &self,
        roles: (&'static str, &'static str),
        w: &weights::DeviceWeight,
        fold: Option<&RouterFold>,
        core: u64,
        stream: (&mut u64, &mut u64),
        b: &MoeBuffers,
        rows: usize,
    ) -> Result<()> {
        let (x, spare) = stream;
        let Some(fold) = fold else {
            return self.matvec(roles.0, w, core, None, *x, Some(*x), rows);
        };
        if rows > 1 {
            self.matvec(roles.0, w, core, None, *spare, Some(*x), rows)?;
            std::mem::swap(x, spare);
            return Ok(());
        }
        let s = &self.stream;
        let (o, f) = (w.desc(s), fold.desc(s));
        let fold_blocks = fold.rows.div_ceil(FOLD_ROWS);
        let warps = MATVEC_THREADS as usize / 32;
        let out_blocks = w
            .rows
            .div_ceil(warps)
            .min(self.k.num_sms as usize * MATVEC_BLOCKS_PER_SM);
        let blocks = (fold_blocks + out_blocks) as u32;
        let smem = staged_bytes(&[w.cols]);
        let fold_blocks = fold_blocks as i32;
        let (raw, ready) = (b.router_logits, self.routing_ready_of(b, 1));
        // SAFETY: core holds w.cols floats, both residual buffers hidden floats, router_logits
        // experts + 1; the fold is [router rows, w.cols + hidden] (router_folds); the staging of
        // core takes `smem` bytes (checked against the limit at construction); ready (when not
        // 0) is one word.
        unsafe {
            self.launch(
                roles.1,
                &self.k.out_proj_route,
                cfg(blocks, 1, MATVEC_THREADS, smem),
                &mut [
                    arg(&o),
                    arg(&f),
                    arg(&core),
                    arg(x),
                    arg(spare),
                    arg(&raw),
                    arg(&fold_blocks),
                    arg(&ready),
                ],
            )
        }?;
        std::mem::swap(x, spare);
        Ok(())
    }

    /// `routing_ready` where one token's `moe_gate_up` publishes the routing early (its
    /// routed input staged for `moe_down`), else 0.
    fn routing_ready_of(&self, b: &MoeBuffers, tokens: usize) -> u64 {
        let format = self.k.expert_format;
        if tokens == 1 && b.routed_staged != 0 && moe_stages_act(&self.config, format) {
            b.routing_ready
        } else {
            0
        }
    }

    /// The MoE block of a layer for `tokens` rows of the residual `x`, added to it, through the
    /// decode kernels (the tokens along the grid's z dimension); `b` holds a row per token.
    /// With `grouped` (a large decode batch), the routed experts go through prefill's grouped
    /// products in that scratch instead, where their weights allow. With `folded`, the
    /// layer's router folded into the mixer's output projection: for one token its raw logits
    /// are already in `b.router_logits` (`out_proj_route`); for several, `moe_router_shared`
    /// computes them from the mixer's output and the stream before it, bit for bit as one
    /// token's launch does, and `moe_route` scales them as one token's `moe_gate_up` does.
    pub(super) fn moe(
        &self,
        layer: &weights::DeviceLayer,
        b: &MoeBuffers,
        x: u64,
        tokens: usize,
        grouped: Option<&GroupedExperts>,
        folded: Option<FoldedRouter>,
    ) -> Result<()> {
        let (c, s) = (&self.config, &self.stream);
        let post = ptr(&layer.post_norm, s);
        let dims = MoeDims::new(c);
        let (router, act, ids, weights) = (b.router_logits, b.act, b.ids, b.weights);
        let (r, g, u, sg, su) = (
            layer.router.desc(s),
            layer.gate.desc(s),
            layer.up.desc(s),
            layer.shared_gate.desc(s),
            layer.shared_up.desc(s),
        );
        let smem = staged_bytes(&[c.hidden_size]);
        let warps = MATVEC_THREADS as usize / 32;
        let gate_up_blocks = |rows: usize| rows.div_ceil(warps * GATE_UP_ROWS_PER_WARP);
        // One token: blocks of gate_up_warps warps, which write moe_down's routed input already
        // staged where the experts' format allows, and then publish the routing early.
        let format = self.k.expert_format;
        let ready = self.routing_ready_of(b, tokens);
        let staged = if ready != 0 { b.routed_staged } else { 0 };
        if folded.is_none() || tokens > 1 {
            // The router's rows (or the folded router's), and the shared expert's.
            let (fold, mixed, before, router_blocks) = match &folded {
                Some(f) => (
                    f.fold.desc(s),
                    f.core,
                    f.before,
                    f.fold.rows.div_ceil(FOLD_ROWS),
                ),
                None => (FoldDesc::default(), 0, 0, layer.router.rows.div_ceil(warps)),
            };
            let blocks = router_blocks.max(gate_up_blocks(c.shared_expert_intermediate_size));
            let mut launch = cfg(blocks as u32, 2, MATVEC_THREADS, smem);
            launch.grid_dim.2 = tokens as u32;
            // SAFETY: per token, router_logits holds experts + 1 floats, act (top_k + 1) *
            // inter; ready (when not 0) is one word; with the fold, mixed and before hold a row
            // of fold.cols - hidden and of hidden floats per token.
            unsafe {
                self.launch(
                    "moe_router_shared",
                    &self.k.moe_router_shared,
                    launch,
                    &mut [
                        arg(&dims),
                        arg(&r),
                        arg(&fold),
                        arg(&sg),
                        arg(&su),
                        arg(&x),
                        arg(&post),
                        arg(&mixed),
                        arg(&before),
                        arg(&router),
                        arg(&act),
                        arg(&ready),
                    ],
                )
            }?;
        }
        let routed_blocks = gate_up_blocks(c.moe_intermediate_size) as u32;
        if tokens > 1 {
            let scale_from = if folded.is_some() { x } else { 0 };
            let blocks = (routed_blocks, scale_from);
            return self.moe_tokens(layer, &dims, b, x, tokens, blocks, grouped);
        }
        let folded = folded.is_some();
        let warps = gate_up_warps(format);
        let row_blocks = gate_up_row_blocks(c, format);
        let blocks = row_blocks * c.num_experts_per_tok;
        // Folded: the shared expert's slice after the staged input (shared_slice_bytes).
        let slice = if folded {
            shared_slice_bytes(c, layer.gate.format(), blocks) as u32
        } else {
            0
        };
        let launch = cfg(
            row_blocks as u32,
            c.num_experts_per_tok as u32,
            (warps * 32) as u32,
            smem + slice,
        );
        let folded = folded as i32;
        // SAFETY: as above; ids and weights hold top_k + 1 entries, `staged` (when not 0) the
        // staged layout of top_k * intermediate values.
        unsafe {
            self.launch(
                "moe_gate_up",
                &self.k.moe_gate_up,
                launch,
                &mut [
                    arg(&dims),
                    arg(&g),
                    arg(&u),
                    arg(&sg),
                    arg(&su),
                    arg(&x),
                    arg(&post),
                    arg(&router),
                    arg(&act),
                    arg(&ids),
                    arg(&weights),
                    arg(&staged),
                    arg(&ready),
                    arg(&folded),
                ],
            )
        }?;
        let routing = DownRouting::FromGateUp { staged, ready };
        self.moe_down_launch(layer, &dims, act, ids, weights, x, 1, routing)
    }

    /// The routed experts of the MoE block for several tokens (after `moe_router_shared`):
    /// each token routed once (`moe_route`), then `moe_gate_up_tokens`, whose blocks take
    /// several tokens each (`routed_blocks` blocks along x, as `moe_gate_up`), and `moe_down`.
    /// With `grouped` and expert weights that `experts_group` takes, the routed experts
    /// go through prefill's grouped products instead, and `matvec_mma` adds the shared
    /// expert's term for all the tokens at once.
    /// `blocks`: the routed blocks along x, and where the router is folded the residual stream
    /// whose 1 / rms scales its raw logits (else 0).
    #[allow(clippy::too_many_arguments)]
    fn moe_tokens(
        &self,
        layer: &weights::DeviceLayer,
        dims: &MoeDims,
        b: &MoeBuffers,
        x: u64,
        tokens: usize,
        blocks: (u32, u64),
        grouped: Option<&GroupedExperts>,
    ) -> Result<()> {
        let (c, s) = (&self.config, &self.stream);
        let (routed_blocks, scale_from) = blocks;
        let (router, act, ids, weights) = (b.router_logits, b.act, b.ids, b.weights);
        let (splits, split_stride) = (1i32, 0usize);
        // SAFETY: router_logits holds experts + 1 floats per token, ids and weights top_k + 1;
        // scale_from (when not 0) a row of hidden floats per token.
        unsafe {
            self.launch(
                "moe_route",
                &self.k.moe_route,
                cfg(tokens as u32, 1, MATVEC_THREADS, 0),
                &mut [
                    arg(dims),
                    arg(&router),
                    arg(&splits),
                    arg(&split_stride),
                    arg(&scale_from),
                    arg(&ids),
                    arg(&weights),
                ],
            )
        }?;
        if let Some(g) = grouped.filter(|_| experts_group(layer)) {
            self.routed_experts_grouped(g, layer, x, tokens, (ids, weights))?;
            // The shared expert's down projection for all the tokens at once, weighted by its
            // gate (slot top_k of each token's activations and routing weights).
            let (top_k, width) = (c.num_experts_per_tok, moe_slot_width(c));
            let shared = MmaRows {
                x: act + (top_k * width * 4) as u64,
                x_stride: (top_k + 1) * width,
                norm: 0,
                weight: Some((weights + (top_k * 4) as u64, top_k + 1)),
            };
            return self.matvec_mma(
                "moe_shared_down",
                &layer.shared_down,
                shared,
                x,
                Some(x),
                tokens,
                self.scratch.mma_staging(s),
            );
        }
        let tokens32 = tokens as i32;
        let post = ptr(&layer.post_norm, s);
        let (g, u) = (layer.gate.desc(s), layer.up.desc(s));
        let per_token = 4 * staged_floats_bits(c.hidden_size, layer.gate.bits);
        let (per_block, rows) = moe_token_blocks(tokens, per_token, self.moe_tokens_smem);
        let mut launch = cfg(
            routed_blocks,
            c.num_experts_per_tok as u32,
            MATVEC_THREADS,
            (per_block * per_token) as u32,
        );
        launch.grid_dim.2 = rows as u32;
        let per32 = per_block as i32;
        // SAFETY: act holds a row of (top_k + 1) * intermediate floats per token.
        unsafe {
            self.launch(
                "moe_gate_up_tokens",
                &self.k.moe_gate_up_tokens,
                launch,
                &mut [
                    arg(dims),
                    arg(&g),
                    arg(&u),
                    arg(&x),
                    arg(&post),
                    arg(&ids),
                    arg(&tokens32),
                    arg(&per32),
                    arg(&act),
                ],
            )
        }?;
        // The routing is two launches back by now.
        self.moe_down_launch(
            layer,
            dims,
            act,
            ids,
            weights,
            x,
            tokens,
            DownRouting::Routed,
        )
    }

    /// `moe_down` for `tokens` rows: every slot's down projection, weighted, added to the
    /// residual rows `x`, with the routing as `routing` says.
    #[allow(clippy::too_many_arguments)]
    fn moe_down_launch(
        &self,
        layer: &weights::DeviceLayer,
        dims: &MoeDims,
        act: u64,
        ids: u64,
        weights: u64,
        x: u64,
        tokens: usize,
        routing: DownRouting,
    ) -> Result<()> {
        let (c, s) = (&self.config, &self.stream);
        let (d, sd) = (layer.down.desc(s), layer.shared_down.desc(s));
        // One token's blocks spread over every SM with the floor of `down_smem`; several tokens'
        // run in waves, and four blocks to an SM (moe_down_batched) make fewer of them.
        let smem = if tokens == 1 {
            self.down_smem
        } else {
            moe_down_staged_bytes(c)
        };
        let blocks =
            c.hidden_size
                .div_ceil(MATVEC_THREADS as usize / 32 * DOWN_ROWS_PER_WARP) as u32;
        let mut launch = cfg(blocks, 1, MATVEC_THREADS, smem);
        launch.grid_dim.2 = tokens as u32;
        let (routed_early, routed_staged, ready) = match routing {
            DownRouting::Routed => (1i32, 0, 0),
            DownRouting::FromGateUp { staged, ready } => (0, staged, ready),
        };
        let kernel = if tokens == 1 {
            &self.k.moe_down
        } else {
            &self.k.moe_down_batched
        };
        // SAFETY: act, ids and weights hold `tokens` rows; each output row is owned by one warp.
        unsafe {
            self.launch(
                "moe_down",
                kernel,
                launch,
                &mut [
                    arg(dims),
                    arg(&d),
                    arg(&sd),
                    arg(&act),
                    arg(&ids),
                    arg(&weights),
                    arg(&x),
                    arg(&routed_early),
                    arg(&routed_staged),
                    arg(&ready),
                ],
            )
        }?;
        Ok(())
    }
}

/// Where `moe_down` finds the routing of its tokens.
enum DownRouting {
    /// Written two launches back (`moe_route`): its routed rows are requested before its wait.
    Routed,
    /// Written by the previous launch, `moe_gate_up`, which staged the routed input into
    /// `staged` (0: not staged) and, where `ready` is not 0, says there when the routing is
    /// written, so that the routed rows are requested then, before the wait.
    FromGateUp { staged: u64, ready: u64 },
}

/// Whether a decode batch's routed experts may take prefill's grouped products (4- or 8-bit
/// gate, up and down of one width that the tensor-core products take), and its shared expert's
/// down projection `matvec_mma`. (bf16 batches keep the decode kernels, so that each sequence's
/// results stay bit for bit its own step's.)
fn experts_group(layer: &weights::DeviceLayer) -> bool {
    let bits = layer.gate.bits;
    let sd = &layer.shared_down;
    (bits == 4 || bits == 8)
        && [&layer.gate, &layer.up, &layer.down]
            .iter()
            .all(|w| w.bits == bits && on_tensor_cores(w))
        && mma_takes(sd.bits, sd.group, sd.cols)
}

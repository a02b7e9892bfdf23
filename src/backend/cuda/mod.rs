//! The CUDA backend (H200, sm_90a): hand-written kernels for decode (one sequence, or a batch
//! of sequences in one step), replayed as CUDA graphs, and tensor-core kernels for prefill.
//!
//! A decode step is one graph: embedding; per layer a fused input-norm + projection mat-vec,
//! the fused Gated DeltaNet step or the attention kernels, the output projection added to the
//! residual, then the MoE's three kernels (router with the shared expert, the routed experts'
//! gate/up, every expert's down added to the residual); final norm + lm_head; argmax or a
//! sampled draw. Every
//! step-dependent value (position, input token) lives in device memory, so the graph captured
//! for a sequence slot is replayed unchanged and no host synchronisation happens inside a step.
//! A batched step (a token of each of several sequences, a row each) is one graph per batch size
//! whose kernels find each row's buffers in the batch tables (`BatchTables`).
//!
//! Sequences live in a fixed pool of slots (KV cache for `max_context` positions, conv ring and
//! recurrent state per DeltaNet layer); a [`CudaState`] holds a slot and gives it back on drop.
//! The slots, the batch tables and the launching of a step on them are in sequences.rs, the
//! step's launches in decode.rs, the mat-vec launches in matvec.rs, prefill's (chunks of tokens
//! on tensor cores) in prefill/, the launches' shapes (grids, blocks, shared memory,
//! compiled-in dimensions) in shapes.rs; this module owns the kernels, weights, scratch and the
//! `Backend` methods.

mod decode;
mod gemm;
pub mod kernels;
mod matvec;
mod prefill;
mod sequences;
mod shapes;
pub mod timing;
pub mod weights;

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, ensure};
use cudarc::driver::sys::{
    CUfunction_attribute, CUgraphInstantiate_flags, CUlaunchAttribute, CUlaunchAttributeID,
    CUlaunchAttributeValue, CUlaunchAttributeValue_union__bindgen_ty_1, CUlaunchConfig,
    CUstreamCaptureMode,
};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DeviceRepr, LaunchConfig,
    PushKernelArg,
};

use self::decode::StepSeqs;
use self::matvec::{MmaRows, MmaStaging};
pub use self::sequences::CudaState;
use self::sequences::{BatchSteps, BatchTables, Slot, StepEnd};
use self::shapes::*;
use self::weights::{DeviceLayer, DeviceModel, ScaleFormat, WeightFormat, ptr};
use super::{Backend, DeviceDraw, LogitsFor, MixedStep, PenaltyHistory};
use crate::config::{LayerKind, ModelConfig};
use crate::model::Model;

/// The token count of a decode step's launches (kernels that also take a prefill chunk).
const ONE_TOKEN: i32 = 1;
/// A batch table argument of a launch for one sequence: none (see `seq_buffer` in common.cuh).
const NO_TABLE: u64 = 0;
/// The batch context argument of a step whose sequences take attention splits of their own
/// (see `AttentionSeqs::batch_context`).
const NO_BATCH_CONTEXT: u64 = 0;
/// `struct DeltaNetSeqs` in deltanet.cu: the batch tables' columns of one DeltaNet layer (device
/// addresses of `rows` addresses each), all 0 for a single sequence.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct DeltaNetSeqs {
    conv: u64,
    state: u64,
    position: u64,
}

/// `struct AttentionSeqs` in attention.cu: as `DeltaNetSeqs`, for an attention layer.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct AttentionSeqs {
    position: u64,
    k_cache: u64,
    v_cache: u64,
    /// Where the step's sequences share its context splits: the sum of their context lengths
    /// (`Scratch::batch_context`); 0 where each takes its own.
    batch_context: u64,
}

/// The buffers of one DeltaNet layer's launches (device addresses). A batched step's have no
/// conv ring, state or position of their own (0): the kernels find each sequence's in `seqs`
/// (all 0 for one sequence).
struct DeltaNetParams<'a> {
    dims: &'a DeltaNetDims,
    proj: u64,
    conv: u64,
    conv_w: u64,
    a_log: u64,
    dt_bias: u64,
    norm: u64,
    state: u64,
    position: u64,
    out: u64,
    seqs: DeltaNetSeqs,
}

impl<'a> DeltaNetParams<'a> {
    /// The buffers of the `i`-th DeltaNet layer of `seqs` (one slot's, or the batch tables'
    /// columns), whose weights are `[conv_w, a_log, dt_bias, norm]`: its projections read from
    /// `proj`, its gated output written to `out`.
    fn new(
        dims: &'a DeltaNetDims,
        [conv_w, a_log, dt_bias, norm]: [&CudaSlice<f32>; 4],
        seqs: StepSeqs,
        i: usize,
        proj: u64,
        out: u64,
        s: &CudaStream,
    ) -> Self {
        let p = |x: &CudaSlice<f32>| ptr(x, s);
        let (conv, conv_of) = seqs.buffer(|slot| p(&slot.conv[i]), |t| t.conv(i), s);
        let (state, state_of) = seqs.buffer(|slot| p(&slot.recurrent[i]), |t| t.state(i), s);
        let (position, position_of) =
            seqs.buffer(|slot| ptr(&slot.position, s), |_| BatchTables::POSITION, s);
        Self {
            dims,
            proj,
            conv,
            conv_w: p(conv_w),
            a_log: p(a_log),
            dt_bias: p(dt_bias),
            norm: p(norm),
            state,
            position,
            out,
            seqs: DeltaNetSeqs {
                conv: conv_of,
                state: state_of,
                position: position_of,
            },
        }
    }
}

/// The buffers of one attention layer's launches (device addresses); for a batched step as
/// `DeltaNetParams` says.
struct AttentionBuffers {
    proj: u64,
    q_norm: u64,
    k_norm: u64,
    position: u64,
    q: u64,
    k_cache: u64,
    v_cache: u64,
    out: u64,
    seqs: AttentionSeqs,
}

impl AttentionBuffers {
    /// The buffers of the `i`-th attention layer of `seqs` (one slot's, or the batch tables'
    /// columns), whose q/k norm weights are `[q_norm, k_norm]`: its projections read from
    /// `proj`, the prepared queries kept in `q`, its gated output written to `out`.
    fn new(
        [q_norm, k_norm]: [&CudaSlice<f32>; 2],
        seqs: StepSeqs,
        i: usize,
        proj: u64,
        q: u64,
        out: u64,
        s: &CudaStream,
    ) -> Self {
        let (position, position_of) =
            seqs.buffer(|slot| ptr(&slot.position, s), |_| BatchTables::POSITION, s);
        let (k_cache, k_of) = seqs.buffer(|slot| ptr(&slot.kv[i].0, s), |t| t.keys(i), s);
        let (v_cache, v_of) = seqs.buffer(|slot| ptr(&slot.kv[i].1, s), |t| t.values(i), s);
        Self {
            proj,
            q_norm: ptr(q_norm, s),
            k_norm: ptr(k_norm, s),
            position,
            q,
            k_cache,
            v_cache,
            out,
            seqs: AttentionSeqs {
                position: position_of,
                k_cache: k_of,
                v_cache: v_of,
                batch_context: 0,
            },
        }
    }
}

/// Where attention decode keeps each context split's running maximum, sum and unnormalised
/// output (device addresses).
struct AttentionSplits {
    max: u64,
    sum: u64,
    out: u64,
}

/// What a draw's `sample_scan` leaves for its `sample_finish` (device addresses; `struct
/// SampleParts` in sample.cu).
#[repr(C)]
struct SampleParts {
    block_max: u64,
    rest: u64,
    cut: u64,
    draw_val: u64,
    draw_id: u64,
    candidate_logit: u64,
    candidate_id: u64,
}

// SAFETY: plain old data mirroring `struct SampleParts` in sample.cu.
unsafe impl DeviceRepr for SampleParts {}

/// Where the MoE launches keep their per-token rows (device addresses).
struct MoeBuffers {
    router_logits: u64,
    act: u64,
    ids: u64,
    weights: u64,
    /// One token's routed input to `moe_down`, staged by `moe_gate_up` (0: none, `moe_down`
    /// stages it from `act`).
    routed_staged: u64,
    /// Where one token's `moe_gate_up` says its routing is written (`Scratch::routing_ready`).
    routing_ready: u64,
}

// SAFETY: plain old data mirroring the structs of the same names in the kernel sources.
unsafe impl DeviceRepr for DeltaNetSeqs {}
unsafe impl DeviceRepr for AttentionSeqs {}

/// Kernels that fill device memory (synthetic weights).
pub struct Fill {
    bf16: CudaFunction,
    u32: CudaFunction,
}

impl Fill {
    fn launch_cfg(n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (n.div_ceil(256).clamp(1, 4096) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    pub fn bf16(&self, s: &CudaStream, out: u64, n: usize, seed: u64, scale: f32) -> Result<()> {
        let n64 = n as u64;
        let mut b = s.launch_builder(&self.bf16);
        b.arg(&out).arg(&n64).arg(&seed).arg(&scale);
        // SAFETY: `out` points to `n` bf16 values allocated by the caller.
        unsafe { b.launch(Self::launch_cfg(n)) }?;
        Ok(())
    }

    pub fn u32(&self, s: &CudaStream, out: u64, n: usize, seed: u64) -> Result<()> {
        let n64 = n as u64;
        let mut b = s.launch_builder(&self.u32);
        b.arg(&out).arg(&n64).arg(&seed);
        // SAFETY: `out` points to `n` u32 values allocated by the caller.
        unsafe { b.launch(Self::launch_cfg(n)) }?;
        Ok(())
    }
}

struct Kernels {
    /// Where traced kernels record their blocks' timelines (`LILY_TRACE_RECORDS` set; see
    /// `CudaBackend::decode_trace`).
    block_trace: Option<Mutex<CudaSlice<u64>>>,
    /// The expert matrices' format the `moe` module was compiled for, if any.
    expert_format: Option<WeightFormat>,
    /// The GPU's SM count, which the mat-vecs were compiled for (`MATVEC_WARM_BLOCKS`).
    num_sms: u32,
    matvec: CudaFunction,
    matvec_two_rows: CudaFunction,
    matvec_tokens: CudaFunction,
    matvec_two_rows_tokens: CudaFunction,
    /// Blocks of 1, 2 and 4 tiles of MMA_TOKENS tokens.
    matvec_mma: [CudaFunction; 3],
    embed: CudaFunction,
    deltanet_step: CudaFunction,
    deltanet_step_batched: CudaFunction,
    deltanet_conv_ring: CudaFunction,
    deltanet_conv_chunk: CudaFunction,
    deltanet_norm_chunk: CudaFunction,
    deltanet_scan: CudaFunction,
    deltanet_chunk_prepare: CudaFunction,
    deltanet_chunk_state: CudaFunction,
    deltanet_chunk_output: CudaFunction,
    deltanet_gated_norm: CudaFunction,
    attention_prepare: CudaFunction,
    attention_split: CudaFunction,
    attention_split_shared: CudaFunction,
    attention_combine: CudaFunction,
    attention_prefill: CudaFunction,
    moe_router_shared: CudaFunction,
    fold_router: CudaFunction,
    fold_to_half: CudaFunction,
    out_proj_route: CudaFunction,
    moe_gate_up: CudaFunction,
    moe_down: CudaFunction,
    moe_down_batched: CudaFunction,
    moe_gate_up_tokens: CudaFunction,
    argmax_partial: CudaFunction,
    argmax_final: CudaFunction,
    sample_scan: CudaFunction,
    sample_finish: CudaFunction,
    advance_position: CudaFunction,
    rows_to_half: CudaFunction,
    gemm_q: CudaFunction,
    gemm_q_grouped: CudaFunction,
    gemm_q_grouped_wide: CudaFunction,
    swiglu_to_half: CudaFunction,
    add_expert_rows: CudaFunction,
    moe_route: CudaFunction,
    moe_group: CudaFunction,
    wgmma_peak: CudaFunction,
}

/// Activations of one decode step, a row per sequence of a batched step (up to the backend's
/// slots), shared by all steps (they run one after another).
struct Scratch {
    x: CudaSlice<f32>,
    /// The residual stream's other buffer: a one-token step whose router is folded into the
    /// mixer's output projection writes the stream from one to the other (`out_proj_route`).
    x_next: CudaSlice<f32>,
    proj: CudaSlice<f32>,
    core: CudaSlice<f32>,
    q: CudaSlice<f32>,
    part_max: CudaSlice<f32>,
    part_sum: CudaSlice<f32>,
    part_out: CudaSlice<f32>,
    router_logits: CudaSlice<f32>,
    act: CudaSlice<f32>,
    /// One token's routed activations in `moe_down`'s staged layout (`MoeBuffers::routed_staged`).
    routed_staged: CudaSlice<f32>,
    /// One token's MoE block: 1 once `moe_gate_up` has written the routing, so that `moe_down`
    /// requests its routed rows before its wait (`moe_router_shared` clears it).
    routing_ready: CudaSlice<u32>,
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    arg_val: CudaSlice<f32>,
    arg_idx: CudaSlice<i32>,
    /// What `sample_scan` leaves for `sample_finish` (`SampleParts`), SAMPLE_MAX_BLOCKS entries
    /// per row (SAMPLE_CANDIDATES each for the candidates).
    sample_max: CudaSlice<f32>,
    sample_rest: CudaSlice<f32>,
    sample_cut: CudaSlice<u32>,
    sample_val: CudaSlice<f32>,
    sample_id: CudaSlice<i32>,
    candidate_logit: CudaSlice<f32>,
    candidate_id: CudaSlice<i32>,
    /// A batched step's chosen ids, a row each (the slots' token buffers hold them too).
    chosen: CudaSlice<i32>,
    /// The sum of a batched step's context lengths, for attention splits shared in proportion
    /// to them (see `step_shares_attention_splits`).
    batch_context: CudaSlice<i32>,
    /// A batched step's inputs to `matvec_mma`, staged in fp16 (see `MmaStaging`).
    mma_x16: CudaSlice<u16>,
    mma_xscale: CudaSlice<f32>,
}

impl Scratch {
    fn bytes(&self) -> usize {
        [
            &self.x,
            &self.proj,
            &self.core,
            &self.q,
            &self.part_max,
            &self.part_sum,
            &self.part_out,
            &self.router_logits,
            &self.act,
            &self.routed_staged,
            &self.weights,
            &self.logits,
            &self.arg_val,
            &self.sample_max,
            &self.sample_rest,
            &self.sample_val,
            &self.candidate_logit,
        ]
        .iter()
        .map(|v| v.num_bytes())
        .sum::<usize>()
            + self.ids.num_bytes()
            + self.arg_idx.num_bytes()
            + self.sample_cut.num_bytes()
            + self.routing_ready.num_bytes()
            + self.sample_id.num_bytes()
            + self.candidate_id.num_bytes()
            + self.chosen.num_bytes()
            + self.batch_context.num_bytes()
            + self.mma_x16.num_bytes()
            + self.mma_xscale.num_bytes()
    }

    fn mma_staging(&self, s: &CudaStream) -> MmaStaging {
        MmaStaging::of(&self.mma_x16, &self.mma_xscale, s)
    }

    fn sample_parts(&self, s: &CudaStream) -> SampleParts {
        SampleParts {
            block_max: ptr(&self.sample_max, s),
            rest: ptr(&self.sample_rest, s),
            cut: ptr(&self.sample_cut, s),
            draw_val: ptr(&self.sample_val, s),
            draw_id: ptr(&self.sample_id, s),
            candidate_logit: ptr(&self.candidate_logit, s),
            candidate_id: ptr(&self.candidate_id, s),
        }
    }
}

/// Runs a model on one CUDA device.
pub struct CudaBackend {
    config: ModelConfig,
    _ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    k: Kernels,
    model: DeviceModel,
    /// The format of the quantised weights' scales and biases, which the kernels were compiled for.
    scales: ScaleFormat,
    scratch: Scratch,
    slots: Mutex<Vec<Slot>>,
    batch: Mutex<BatchSteps>,
    free: Arc<Mutex<Vec<usize>>>,
    max_context: usize,
    use_graphs: bool,
    /// Most context splits of a decode step's attention: as many blocks as fit on the GPU at
    /// once (see `decode_attention_splits`).
    attention_splits: usize,
    /// Dynamic shared memory `moe_down` asks for (see `moe_down_smem`).
    down_smem: u32,
    /// Dynamic shared memory a block of `moe_gate_up_tokens` may take: two to an SM.
    moe_tokens_smem: usize,
    /// Chunk activations of the prefill path, allocated with the backend so that the first
    /// prompt does not pay for them.
    prefill: Mutex<prefill::PrefillScratch>,
    /// Where in it large decode batches' routed experts are grouped (`record_step`).
    grouped_experts: prefill::GroupedExperts,
    /// Tokens per prefill chunk (`CudaOptions::prefill_chunk`).
    prefill_chunk: usize,
    /// Per-part prefill timing, when `time_prefill_parts` runs.
    timer: Mutex<timing::PartTimer>,
    /// Truncates recorded decode steps, when `decode_critical_path` runs.
    prefix: timing::LaunchPrefix,
}

/// Device memory a backend holds, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryUse {
    /// The model's weights (and norm vectors).
    pub weights: usize,
    /// Every sequence slot: KV caches, DeltaNet conv and recurrent states, positions.
    pub sequences: usize,
    /// Activations of decode and prefill steps, shared by all sequences.
    pub scratch: usize,
}

impl MemoryUse {
    pub fn total(&self) -> usize {
        self.weights + self.sequences + self.scratch
    }
}

/// Options of the CUDA backend.
#[derive(Clone, Copy, Debug)]
pub struct CudaOptions {
    /// Longest sequence (prompt + output) a slot holds.
    pub max_context: usize,
    /// Sequences that can be alive at once (the backend refuses to start without room for them,
    /// unless `fit_sequences`).
    pub max_sequences: usize,
    /// Take fewer than `max_sequences` slots (at least one) where the free device memory holds
    /// fewer with `SPARE_SLOT_RESERVE` left over (a GPU shared with other processes):
    /// `Backend::max_states` says how many came.
    pub fit_sequences: bool,
    /// More sequence slots (for states kept aside, as the prefix cache does), allocated last and
    /// only while they leave `SPARE_SLOT_RESERVE` of the device free, so a GPU shared with other
    /// processes gets fewer rather than none (`Backend::max_states` says how many came).
    pub spare_sequences: usize,
    /// Replay each step as a CUDA graph (off: launch kernels one by one, for profilers).
    pub use_graphs: bool,
    /// Prompt tokens run through the model at once by prefill: larger chunks read the expert
    /// weights fewer times and give the grouped products more tokens per expert, but take more
    /// scratch memory (about 0.17 GB per 1,024 tokens at full size) and hold up the decode
    /// steps of other sequences longer.
    pub prefill_chunk: usize,
    /// Fold each layer's router into its mixer's output projection for decode (one dependent
    /// launch fewer per layer; see `out_proj_route` in moe.cu). Off: the router's own launch,
    /// as layers whose fold does not fit take anyway (for comparisons).
    pub fold_router: bool,
}

/// Device memory that spare sequence slots leave free (for the driver, graphs and other
/// processes' growth).
const SPARE_SLOT_RESERVE: usize = 2 << 30;

/// How many sequence slots of `slot_bytes` to allocate with `free` bytes of device memory:
/// `opts.max_sequences`, or with `fit_sequences` as many of them as leave `SPARE_SLOT_RESERVE`
/// free (at least one). Fails with what to change, not the driver's out-of-memory, when the
/// device (shared with other processes, perhaps) cannot hold them.
fn sequence_slots(opts: &CudaOptions, slot_bytes: usize, free: usize) -> Result<usize> {
    let mut sequences = opts.max_sequences;
    if opts.fit_sequences {
        let fit = free.saturating_sub(SPARE_SLOT_RESERVE) / slot_bytes.max(1);
        if fit < sequences {
            tracing::warn!(
                slots = fit.max(1),
                context = opts.max_context,
                free_gb = free as f64 / 1e9,
                "the free GPU memory holds fewer sequence slots than the default batch: serving \
                 that many at once (--max-batch sets it, --context shortens them)"
            );
        }
        sequences = fit.clamp(1, sequences);
    }
    ensure!(
        slot_bytes * sequences <= free,
        "{} sequence slots of {} tokens need {:.2} GB of GPU memory, but {:.2} GB is free \
         (other processes may hold the rest): serve fewer (--max-batch) or shorter (--context) \
         sequences",
        sequences,
        opts.max_context,
        (slot_bytes * sequences) as f64 / 1e9,
        free as f64 / 1e9
    );
    Ok(sequences)
}

/// `CudaOptions::prefill_chunk` unless told otherwise.
pub const DEFAULT_PREFILL_CHUNK: usize = 4096;

impl CudaBackend {
    /// Uploads a loaded model to device 0.
    pub fn new(model: &Model, opts: CudaOptions) -> Result<Self> {
        let scales = ScaleFormat::for_model(model);
        let experts = DeviceModel::expert_format_of_upload(model);
        let (ctx, stream, k, fill) = Self::init(&model.config, scales, experts)?;
        let bar = indicatif::ProgressBar::new(model.layers.len() as u64).with_message("uploading");
        let weights = DeviceModel::upload(&stream, model, scales, |i| bar.set_position(i as u64))?;
        bar.finish_and_clear();
        drop(fill);
        Self::assemble(model.config.clone(), ctx, stream, k, weights, scales, opts)
    }

    /// Random weights of `config`'s shapes, made on the device (benchmarks).
    pub fn synthetic(
        config: &ModelConfig,
        format: WeightFormat,
        opts: CudaOptions,
    ) -> Result<Self> {
        // The synthetic weights' scales are generated as bf16.
        let scales = ScaleFormat::Bf16;
        let (ctx, stream, k, fill) = Self::init(config, scales, Some(format))?;
        let weights = DeviceModel::synthetic(&stream, &fill, config, format)
            .context("generating the synthetic weights on the GPU")?;
        stream.synchronize()?;
        Self::assemble(config.clone(), ctx, stream, k, weights, scales, opts)
    }

    /// The context, stream and kernels (compiled for scales and biases in `scales`, for
    /// `config`'s shapes, and for expert matrices in `experts` where that is known: the weights
    /// must then be stored so, which `assemble` checks).
    fn init(
        config: &ModelConfig,
        scales: ScaleFormat,
        experts: Option<WeightFormat>,
    ) -> Result<(Arc<CudaContext>, Arc<CudaStream>, Kernels, Fill)> {
        // cudarc panics where it cannot load the driver; say what is missing instead.
        // SAFETY: only opens (and closes) the shared library by its possible names.
        ensure!(
            unsafe { cudarc::driver::sys::is_culib_present() },
            "no NVIDIA driver found (libcuda.so is not on the library path): the CUDA backend \
             needs an NVIDIA GPU and its driver; run with `--device cpu` instead"
        );
        let ctx = CudaContext::new(0).context("no CUDA device (is the NVIDIA driver loaded?)")?;
        // SAFETY: lily uses one stream, so cudarc's cross-stream event tracking is not needed
        // (and its events would get in the way of graph capture).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let block_trace = match std::env::var("LILY_TRACE_RECORDS") {
            Ok(records) => {
                let records: usize = records
                    .parse()
                    .context("LILY_TRACE_RECORDS must be a number of block records")?;
                Some(stream.alloc_zeros::<u64>(
                    timing::TRACE_HEADER_WORDS + timing::TRACE_RECORD_WORDS * records,
                )?)
            }
            Err(_) => None,
        };
        let num_sms = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as u32;
        let experiments = kernels::experiment_defines();
        // The mat-vecs' first blocks, one per SM, keep the weights-first order (rowdot.cuh).
        let warm_blocks = (!experiments
            .iter()
            .any(|d| d.starts_with("MATVEC_WARM_BLOCKS=")))
        .then(|| format!("MATVEC_WARM_BLOCKS={num_sms}"));
        let defines: Vec<String> = block_trace
            .iter()
            .flat_map(|b| {
                [
                    format!("LILY_TRACE_BUF={}ull", ptr(b, &stream)),
                    format!(
                        "LILY_TRACE_CAP={}",
                        (b.len() - timing::TRACE_HEADER_WORDS) / timing::TRACE_RECORD_WORDS
                    ),
                ]
            })
            .chain(scales.define().map(String::from))
            .chain(warm_blocks)
            .chain(experiments)
            .collect();
        let block_trace = block_trace.map(Mutex::new);
        let shape = shape_defines(config, experts);
        let mut functions = std::collections::HashMap::new();
        for (name, ptx) in kernels::compile_all(&defines, &shape)? {
            let module = match ctx.load_module(ptx) {
                Ok(module) => module,
                Err(_) => ctx
                    .load_module(kernels::recompile(name, &defines, &shape)?)
                    .with_context(|| format!("loading kernel module `{name}`"))?,
            };
            for f in kernels::kernel_names(name) {
                functions.insert(*f, module.load_function(f)?);
            }
        }
        let mut get = |name: &str| {
            functions
                .remove(name)
                .with_context(|| format!("kernel `{name}` missing"))
        };
        let k = Kernels {
            block_trace,
            expert_format: experts,
            num_sms,
            matvec: get("matvec")?,
            matvec_two_rows: get("matvec_two_rows")?,
            matvec_tokens: get("matvec_tokens")?,
            matvec_two_rows_tokens: get("matvec_two_rows_tokens")?,
            matvec_mma: [
                get("matvec_mma")?,
                get("matvec_mma_16")?,
                get("matvec_mma_32")?,
            ],
            embed: get("embed")?,
            deltanet_step: get("deltanet_step")?,
            deltanet_step_batched: get("deltanet_step_batched")?,
            deltanet_conv_ring: get("deltanet_conv_ring")?,
            deltanet_conv_chunk: get("deltanet_conv_chunk")?,
            deltanet_norm_chunk: get("deltanet_norm_chunk")?,
            deltanet_scan: get("deltanet_scan")?,
            deltanet_chunk_prepare: get("deltanet_chunk_prepare")?,
            deltanet_chunk_state: get("deltanet_chunk_state")?,
            deltanet_chunk_output: get("deltanet_chunk_output")?,
            deltanet_gated_norm: get("deltanet_gated_norm")?,
            attention_prepare: get("attention_prepare")?,
            attention_split: get("attention_split")?,
            attention_split_shared: get("attention_split_shared")?,
            attention_combine: get("attention_combine")?,
            attention_prefill: get("attention_prefill")?,
            moe_router_shared: get("moe_router_shared")?,
            fold_router: get("fold_router")?,
            fold_to_half: get("fold_to_half")?,
            out_proj_route: get("out_proj_route")?,
            moe_gate_up: get("moe_gate_up")?,
            moe_down: get("moe_down")?,
            moe_down_batched: get("moe_down_batched")?,
            moe_gate_up_tokens: get("moe_gate_up_tokens")?,
            argmax_partial: get("argmax_partial")?,
            argmax_final: get("argmax_final")?,
            sample_scan: get("sample_scan")?,
            sample_finish: get("sample_finish")?,
            advance_position: get("advance_position")?,
            rows_to_half: get("rows_to_half")?,
            gemm_q: get("gemm_q")?,
            gemm_q_grouped: get("gemm_q_grouped")?,
            gemm_q_grouped_wide: get("gemm_q_grouped_wide")?,
            swiglu_to_half: get("swiglu_to_half")?,
            add_expert_rows: get("add_expert_rows")?,
            moe_route: get("moe_route")?,
            moe_group: get("moe_group")?,
            wgmma_peak: get("wgmma_peak")?,
        };
        // Kernels that stage inputs in dynamic shared memory may use more than the default 48 KB.
        for f in [
            &k.matvec,
            &k.matvec_two_rows,
            &k.matvec_tokens,
            &k.matvec_two_rows_tokens,
            &k.matvec_mma[0],
            &k.matvec_mma[1],
            &k.matvec_mma[2],
            &k.moe_router_shared,
            &k.out_proj_route,
            &k.moe_gate_up,
            &k.moe_down,
            &k.moe_down_batched,
            &k.moe_gate_up_tokens,
            &k.deltanet_step,
            &k.deltanet_step_batched,
            &k.gemm_q,
            &k.gemm_q_grouped,
            &k.gemm_q_grouped_wide,
            &k.attention_prefill,
            &k.attention_split,
            &k.attention_split_shared,
            &k.deltanet_chunk_prepare,
            &k.deltanet_chunk_state,
            &k.deltanet_chunk_output,
        ] {
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                MAX_DYNAMIC_SHARED_BYTES as i32,
            )?;
        }
        let fill = Fill {
            bf16: get("fill_bf16")?,
            u32: get("fill_u32")?,
        };
        Ok((ctx, stream, k, fill))
    }

    fn assemble(
        config: ModelConfig,
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        k: Kernels,
        model: DeviceModel,
        scales: ScaleFormat,
        opts: CudaOptions,
    ) -> Result<Self> {
        let c = &config;
        // The moe module carries only the path of the format it was compiled for.
        ensure!(
            k.expert_format.is_none() || k.expert_format == model.expert_format(),
            "the MoE kernels were compiled for expert matrices stored as {:?}, but they are \
             stored as {:?}",
            k.expert_format,
            model.expert_format()
        );
        ensure!(
            opts.max_sequences > 0,
            "the CUDA backend needs at least one sequence slot"
        );
        ensure!(
            opts.prefill_chunk > 0,
            "the prefill chunk must hold at least one token"
        );
        ensure!(
            c.head_dim.is_multiple_of(32) && c.head_dim <= 256,
            "head_dim {} unsupported by the CUDA kernels (a multiple of 32, at most 256)",
            c.head_dim
        );
        ensure!(
            DeltaNetShape::of(c).is_some(),
            "DeltaNet head dims {}x{} with a conv of {} taps unsupported by the CUDA kernels \
             (at most {DELTANET_MAX_CONV_KERNEL} taps)",
            c.linear_key_head_dim,
            c.linear_value_head_dim,
            c.linear_conv_kernel_dim
        );
        ensure!(
            c.num_attention_heads / c.num_key_value_heads <= 16,
            "more than 16 query heads per KV head unsupported by the CUDA kernels"
        );
        ensure!(
            c.num_experts_per_tok <= 32 && c.num_experts <= 1024,
            "{} experts with top-{} unsupported by the CUDA kernels (at most 1024 experts, top-32)",
            c.num_experts,
            c.num_experts_per_tok
        );
        let widest = [
            c.hidden_size,
            c.linear_value_dim(),
            c.num_attention_heads * c.head_dim,
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        ensure!(
            staged_bytes(&[widest]) as usize <= MAX_DYNAMIC_SHARED_BYTES
                && moe_down_staged_bytes(c) as usize <= MAX_DYNAMIC_SHARED_BYTES,
            "layer widths too large for the CUDA kernels' shared-memory staging"
        );
        // Decode folds each layer's router into its mixer's output projection where
        // moe_gate_up's slice of the shared expert fits beside its staged input.
        let mut model = model;
        let gate_up_blocks = gate_up_row_blocks(c, k.expert_format) * c.num_experts_per_tok;
        let fits = |l: &DeviceLayer| {
            let slice = shared_slice_bytes(c, l.gate.format(), gate_up_blocks);
            staged_bytes(&[c.hidden_size]) as usize + slice <= MAX_DYNAMIC_SHARED_BYTES
        };
        if opts.fold_router {
            model.fold_routers(&stream, [&k.fold_router, &k.fold_to_half], fits)?;
        }
        ensure!(
            sample_slices(c.vocab_size).is_some(),
            "vocab_size {} is too large for the CUDA sampler (at most {})",
            c.vocab_size,
            SAMPLE_MAX_BLOCKS * SAMPLE_MAX_SLICE
        );
        let heads_hd = c.num_attention_heads * c.head_dim;
        let proj = (c.linear_conv_dim() + c.linear_value_dim() + 2 * c.linear_num_value_heads)
            .max(heads_hd * 2 + 2 * c.num_key_value_heads * c.head_dim);
        let inter = moe_slot_width(c);
        let rows = opts.max_sequences;
        let z = |n: usize| stream.alloc_zeros::<f32>((n * rows).max(1));
        let scratch = Scratch {
            x: z(c.hidden_size)?,
            x_next: z(c.hidden_size)?,
            proj: z(proj)?,
            core: z(c.linear_value_dim().max(heads_hd))?,
            q: z(heads_hd)?,
            part_max: z(c.num_attention_heads * ATTENTION_SPLITS)?,
            part_sum: z(c.num_attention_heads * ATTENTION_SPLITS)?,
            part_out: z(heads_hd * ATTENTION_SPLITS)?,
            // Whole 16-byte pieces: the folded moe_gate_up copies one token's logits by cp.async.
            router_logits: z((c.num_experts + 1).next_multiple_of(4))?,
            act: z((c.num_experts_per_tok + 1) * inter)?,
            routed_staged: stream.alloc_zeros::<f32>(
                staged_floats_bits(c.num_experts_per_tok * c.moe_intermediate_size, 4).max(1),
            )?,
            routing_ready: stream.alloc_zeros::<u32>(1)?,
            ids: stream.alloc_zeros::<i32>((c.num_experts_per_tok + 1) * rows)?,
            weights: z(c.num_experts_per_tok + 1)?,
            logits: z(c.vocab_size)?,
            arg_val: z(ARGMAX_BLOCKS)?,
            arg_idx: stream.alloc_zeros::<i32>(ARGMAX_BLOCKS * rows)?,
            sample_max: z(SAMPLE_MAX_BLOCKS)?,
            sample_rest: z(SAMPLE_MAX_BLOCKS)?,
            sample_cut: stream.alloc_zeros::<u32>(SAMPLE_MAX_BLOCKS * rows)?,
            sample_val: z(SAMPLE_MAX_BLOCKS)?,
            sample_id: stream.alloc_zeros::<i32>(SAMPLE_MAX_BLOCKS * rows)?,
            candidate_logit: z(SAMPLE_MAX_BLOCKS * SAMPLE_CANDIDATES)?,
            candidate_id: stream
                .alloc_zeros::<i32>(SAMPLE_MAX_BLOCKS * SAMPLE_CANDIDATES * rows)?,
            chosen: stream.alloc_zeros::<i32>(rows)?,
            batch_context: stream.alloc_zeros::<i32>(1)?,
            mma_x16: stream.alloc_zeros::<u16>(MmaStaging::halves(rows, widest.max(inter)))?,
            mma_xscale: stream.alloc_zeros::<f32>(MmaStaging::rows(rows))?,
        };
        let batch = BatchSteps {
            tables: BatchTables::new(&stream, c, rows)?,
            graphs: HashMap::new(),
        };
        // Fail with what to change, not the driver's out-of-memory, when the device (shared with
        // other processes, perhaps) cannot hold the slots.
        let slot_bytes = Self::slot_bytes(c, opts.max_context);
        let (free, _) = cudarc::driver::result::mem_get_info()?;
        let sequences = sequence_slots(&opts, slot_bytes, free)?;
        let mut slots = Vec::with_capacity(sequences + opts.spare_sequences);
        for _ in 0..sequences {
            slots.push(Self::new_slot(&stream, c, opts.max_context)?);
        }
        let smem_per_sm = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
        )? as u32;
        let down_smem = moe_down_smem(c, smem_per_sm);
        let split_blocks = k
            .attention_split
            .occupancy_max_active_blocks_per_multiprocessor(
                (ATTENTION_WARPS * 32) as u32,
                attention_split_smem(c.head_dim) as usize,
                None,
            )
            .context("occupancy of attention_split")?;
        let attention_splits =
            decode_attention_splits(c, k.num_sms as usize, split_blocks as usize);
        // Each block also reserves 1 KB, and the kernels' static arrays take a few hundred bytes.
        let moe_tokens_smem = (smem_per_sm as usize / 2)
            .saturating_sub(2048)
            .min(MAX_DYNAMIC_SHARED_BYTES);
        let prefill_chunk = opts.prefill_chunk.min(opts.max_context);
        let prefill = prefill::PrefillScratch::new(&stream, c, prefill_chunk)?;
        let grouped_experts = prefill.grouped_experts(&stream);
        for _ in 0..opts.spare_sequences {
            let (free, _) = cudarc::driver::result::mem_get_info()?;
            if free < slot_bytes + SPARE_SLOT_RESERVE {
                break;
            }
            slots.push(Self::new_slot(&stream, c, opts.max_context)?);
        }
        if slots.len() < sequences + opts.spare_sequences {
            tracing::warn!(
                wanted = opts.spare_sequences,
                got = slots.len() - sequences,
                "the free GPU memory holds fewer spare sequence slots than wanted"
            );
        }
        let total_slots = slots.len();
        stream.synchronize()?;
        Ok(Self {
            config,
            _ctx: ctx,
            stream,
            k,
            model,
            scales,
            scratch,
            slots: Mutex::new(slots),
            batch: Mutex::new(batch),
            free: Arc::new(Mutex::new((0..total_slots).rev().collect())),
            max_context: opts.max_context,
            use_graphs: opts.use_graphs,
            attention_splits,
            down_smem,
            moe_tokens_smem,
            prefill: Mutex::new(prefill),
            grouped_experts,
            prefill_chunk,
            timer: Mutex::new(timing::PartTimer::default()),
            prefix: timing::LaunchPrefix::default(),
        })
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> usize {
        self.model.bytes()
    }

    /// Bytes one decode step reads or writes at `context` positions: every weight except the
    /// routed experts, top-k / experts of those, one embedding row, the DeltaNet states (read
    /// and written) and the KV cache up to `context`; where a layer's router is folded into its
    /// mixer's output projection, the fold instead of the router.
    pub fn decode_bytes_per_token(&self, context: usize) -> usize {
        let c = &self.config;
        let m = &self.model;
        let experts: usize = m
            .layers
            .iter()
            .map(|l| l.gate.bytes() + l.up.bytes() + l.down.bytes())
            .sum();
        let routed = experts * c.num_experts_per_tok / c.num_experts;
        let embed_row = m.embed.bytes() / c.vocab_size;
        let gdn_layers = c
            .layer_kinds
            .iter()
            .filter(|k| **k == LayerKind::LinearAttention)
            .count();
        let attn_layers = c.num_layers() - gdn_layers;
        let state = gdn_layers
            * 2
            * 4
            * c.linear_num_value_heads
            * c.linear_key_head_dim
            * c.linear_value_head_dim;
        let kv = attn_layers * 2 * 2 * context * c.num_key_value_heads * c.head_dim;
        let unread_routers: usize = m
            .layers
            .iter()
            .filter(|l| l.router_fold.is_some())
            .map(|l| l.router.bytes())
            .sum();
        m.bytes() - experts - m.embed.bytes() - unread_routers + routed + embed_row + state + kv
    }

    /// Measures device-to-device copy bandwidth (bytes read + written per second).
    pub fn copy_bandwidth(&self) -> Result<f64> {
        const BYTES: usize = 1 << 30;
        let s = &self.stream;
        let src = s.alloc_zeros::<u8>(BYTES)?;
        let mut dst = s.alloc_zeros::<u8>(BYTES)?;
        s.memcpy_dtod(&src, &mut dst)?;
        s.synchronize()?;
        let iters = 20;
        let start = std::time::Instant::now();
        for _ in 0..iters {
            s.memcpy_dtod(&src, &mut dst)?;
        }
        s.synchronize()?;
        Ok((2 * BYTES * iters) as f64 / start.elapsed().as_secs_f64())
    }

    /// Runs `work` inside a profiler range, so `ncu --profile-from-start off` (or nsys with
    /// `--capture-range=cudaProfilerApi`) records only it.
    pub fn profile(&self, work: impl FnOnce() -> Result<()>) -> Result<()> {
        self.stream.synchronize()?;
        // SAFETY: plain driver calls on the current context; they only toggle profiling.
        unsafe { cudarc::driver::sys::cuProfilerStart() }.result()?;
        let result = work();
        self.stream.synchronize()?;
        // SAFETY: as above.
        unsafe { cudarc::driver::sys::cuProfilerStop() }.result()?;
        result
    }

    /// Runs `work` (prefills) with the prefill path marking its parts, and returns the GPU time
    /// of each part, in milliseconds.
    pub fn time_prefill_parts(
        &self,
        work: impl FnOnce() -> Result<()>,
    ) -> Result<Vec<(timing::PrefillPart, f64)>> {
        self.timer_lock()?.start(&self.stream)?;
        let result = work();
        let mut timer = self.timer_lock()?;
        let totals = timer.totals_ms();
        *timer = timing::PartTimer::default();
        result?;
        totals
    }

    /// Closes prefill part `part` when `time_prefill_parts` is running.
    fn mark(&self, part: timing::PrefillPart) -> Result<()> {
        self.timer_lock()?.mark(&self.stream, part)
    }

    fn timer_lock(&self) -> Result<std::sync::MutexGuard<'_, timing::PartTimer>> {
        self.timer
            .lock()
            .map_err(|_| anyhow::anyhow!("prefill timer lock poisoned"))
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }

    /// The device memory this backend holds, by use, counted from its own buffers: the driver
    /// only reports how much of the device is in use in all, other processes on it included.
    pub fn memory_use(&self) -> Result<MemoryUse> {
        let lock = |what| anyhow::anyhow!("{what} lock poisoned");
        let sequences = self
            .slots
            .lock()
            .map_err(|_| lock("slot"))?
            .iter()
            .map(Slot::bytes)
            .sum();
        let tables = self
            .batch
            .lock()
            .map_err(|_| lock("batch"))?
            .tables
            .table
            .num_bytes();
        let prefill = self.prefill.lock().map_err(|_| lock("prefill"))?.bytes();
        Ok(MemoryUse {
            weights: self.model.bytes(),
            sequences,
            scratch: self.scratch.bytes() + tables + prefill,
        })
    }

    /// Device bytes one sequence slot of `max_context` positions takes (KV cache, DeltaNet conv
    /// rings and states); the backend holds `max_sequences` of them from the start.
    pub fn slot_bytes(config: &ModelConfig, max_context: usize) -> usize {
        sequences::slot_bytes(config, max_context)
    }

    /// Device memory in use by every process on the device (and the driver), from the driver.
    pub fn device_memory_in_use(&self) -> Result<usize> {
        let (free, total) = cudarc::driver::result::mem_get_info()?;
        Ok(total - free)
    }

    /// One decode step for `seqs`, ending as `end`, captured as a graph (not launched).
    fn capture_step(&self, seqs: StepSeqs, end: StepEnd) -> Result<CudaGraph> {
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let recorded = self.record_step(seqs, end);
        let captured = self.stream.end_capture(
            CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
        )?;
        recorded?;
        captured.context("capturing the decode step produced no graph")
    }

    /// Launches `kernel` on the stream with programmatic dependent launch: its blocks may start
    /// while the previous kernel finishes, and wait for it where common.cuh's
    /// `wait_for_previous_kernel` says (weight loads go out before that).
    ///
    /// # Safety
    /// `params` must point to the kernel's arguments, in order and of the right types, and the
    /// buffers they name must fit the launch.
    unsafe fn launch(
        &self,
        name: &'static str,
        kernel: &CudaFunction,
        cfg: LaunchConfig,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: as for this function.
        unsafe { self.launch_clusters(name, kernel, cfg, 1, params) }
    }

    /// `launch`, with the grid's blocks in clusters of `cluster` consecutive blocks along x
    /// (1: no clusters), which may share their shared memory.
    ///
    /// # Safety
    /// As for `launch`; the grid's x dimension must be a multiple of `cluster`.
    unsafe fn launch_clusters(
        &self,
        name: &'static str,
        kernel: &CudaFunction,
        cfg: LaunchConfig,
        cluster: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        if !self.prefix.admit(name)? {
            return Ok(());
        }
        let mut attributes = [
            CUlaunchAttribute {
                id: CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                value: CUlaunchAttributeValue {
                    programmaticStreamSerializationAllowed: 1,
                },
            },
            CUlaunchAttribute {
                id: CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
                pad: [0; 4],
                value: CUlaunchAttributeValue {
                    clusterDim: CUlaunchAttributeValue_union__bindgen_ty_1 {
                        x: cluster,
                        y: 1,
                        z: 1,
                    },
                },
            },
        ];
        let config = CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: attributes.as_mut_ptr(),
            numAttrs: if cluster > 1 { 2 } else { 1 },
        };
        // SAFETY: the caller vouches for the parameters; config and attributes outlive the call.
        unsafe {
            cudarc::driver::sys::cuLaunchKernelEx(
                &config,
                kernel.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .with_context(|| format!("launching `{name}`"))
    }
}

impl Backend for CudaBackend {
    type State = CudaState;

    /// Greedy decode with the argmax on the device: only the chosen ids come back.
    fn decode_greedy(&self, states: &mut [&mut CudaState], tokens: &[u32]) -> Result<Vec<u32>> {
        if let ([state], [token]) = (&mut *states, tokens) {
            self.step(state, *token, StepEnd::Greedy)?;
            return Ok(vec![self.read_token(state)?]);
        }
        self.step_batch(states, tokens, StepEnd::Greedy)?;
        self.read_chosen(states)
    }

    fn samples_on_device(&self) -> bool {
        true
    }

    fn penalises_on_device(&self) -> bool {
        true
    }

    fn load_penalty_history(&self, state: &mut CudaState, history: &PenaltyHistory) -> Result<()> {
        self.load_history(state, history)
    }

    /// Sampled decode with the draw on the device (`sample_scan`, `sample_finish` in
    /// sample.cu): only the chosen ids come back.
    fn decode_sample(
        &self,
        states: &mut [&mut CudaState],
        tokens: &[u32],
        draws: &[DeviceDraw],
    ) -> Result<Vec<u32>> {
        ensure!(
            states.len() == tokens.len() && states.len() == draws.len(),
            "decode_sample got {} sequences, {} tokens and {} draws",
            states.len(),
            tokens.len(),
            draws.len()
        );
        for (state, draw) in states.iter().zip(draws) {
            self.set_draw(state, draw)?;
        }
        if let ([state], [token]) = (&mut *states, tokens) {
            self.step(state, *token, StepEnd::Sampled)?;
            return Ok(vec![self.read_token(state)?]);
        }
        self.step_batch(states, tokens, StepEnd::Sampled)?;
        self.read_chosen(states)
    }

    /// The step every row draws on the device, rows left to the host with a top-1 draw that
    /// only fills their slot's token: the host's choice replaces it as the next input. Their
    /// logits are the step's own (`sample_scan` reads them in place).
    fn decode_mixed(
        &self,
        states: &mut [&mut CudaState],
        tokens: &[u32],
        draws: &[Option<DeviceDraw>],
    ) -> Result<MixedStep> {
        ensure!(
            states.len() == tokens.len() && states.len() == draws.len(),
            "decode_mixed got {} sequences, {} tokens and {} draws",
            states.len(),
            tokens.len(),
            draws.len()
        );
        let placeholder = DeviceDraw::most_likely(self.config.vocab_size);
        for (state, draw) in states.iter().zip(draws) {
            self.set_draw(state, draw.as_ref().unwrap_or(&placeholder))?;
        }
        let ids = if let ([state], [token]) = (&mut *states, tokens) {
            self.step(state, *token, StepEnd::Sampled)?;
            vec![self.read_token(state)?]
        } else {
            self.step_batch(states, tokens, StepEnd::Sampled)?;
            self.read_chosen(states)?
        };
        let mut logits = Vec::new();
        for (row, (state, draw)) in states.iter_mut().zip(draws).enumerate() {
            if draw.is_none() {
                state.device_token = None;
                logits.extend(self.read_logits_row(row)?);
            }
        }
        let drawn = ids
            .into_iter()
            .zip(draws)
            .map(|(id, draw)| draw.is_some().then_some(id))
            .collect();
        Ok(MixedStep { drawn, logits })
    }

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn max_states(&self) -> Option<usize> {
        self.slots.lock().ok().map(|slots| slots.len())
    }

    fn new_state(&self) -> Result<CudaState> {
        let slot = self
            .free
            .lock()
            .map_err(|_| anyhow::anyhow!("slot lock poisoned"))?
            .pop()
            .context("all CUDA sequence slots are in use")?;
        let mut slots = self.lock_slots()?;
        let sl = &mut slots[slot];
        sl.announce.clear();
        self.stream.memset_zeros(&mut sl.position)?;
        for c in &mut sl.conv {
            self.stream.memset_zeros(c)?;
        }
        for r in &mut sl.recurrent {
            self.stream.memset_zeros(r)?;
        }
        self.stream.memset_zeros(&mut sl.history)?;
        Ok(CudaState {
            slot,
            position: 0,
            device_token: None,
            free: self.free.clone(),
        })
    }

    fn fork(&self, state: &CudaState) -> Result<CudaState> {
        let mut fork = self.new_state()?;
        let mut slots = self.lock_slots()?;
        let (src, dst) = two_mut(&mut slots, state.slot, fork.slot);
        let s = &self.stream;
        s.memcpy_dtod(&src.position, &mut dst.position)?;
        s.memcpy_dtod(&src.token, &mut dst.token)?;
        for (a, b) in src.kv.iter().zip(dst.kv.iter_mut()) {
            s.memcpy_dtod(&a.0, &mut b.0)?;
            s.memcpy_dtod(&a.1, &mut b.1)?;
        }
        for (a, b) in src.conv.iter().zip(dst.conv.iter_mut()) {
            s.memcpy_dtod(a, b)?;
        }
        for (a, b) in src.recurrent.iter().zip(dst.recurrent.iter_mut()) {
            s.memcpy_dtod(a, b)?;
        }
        s.memcpy_dtod(&src.history, &mut dst.history)?;
        drop(slots);
        fork.position = state.position;
        fork.device_token = state.device_token;
        Ok(fork)
    }

    fn prefill(&self, state: &mut CudaState, tokens: &[u32], which: LogitsFor) -> Result<Vec<f32>> {
        ensure!(!tokens.is_empty(), "prefill needs at least one token");
        let mut out = Vec::new();
        let chunks = tokens.chunks(self.prefill_chunk);
        let last = chunks.len() - 1;
        for (i, chunk) in chunks.enumerate() {
            let wanted = (which == LogitsFor::All || i == last).then_some(which);
            out.extend(self.prefill_chunk(state, chunk, wanted)?);
        }
        Ok(out)
    }

    fn decode(&self, states: &mut [&mut CudaState], tokens: &[u32]) -> Result<Vec<f32>> {
        ensure!(
            states.len() == tokens.len(),
            "decode got {} sequences but {} tokens",
            states.len(),
            tokens.len()
        );
        if let ([state], [token]) = (&mut *states, tokens) {
            self.step(state, *token, StepEnd::Logits)?;
            return self.read_logits(1);
        }
        self.step_batch(states, tokens, StepEnd::Logits)?;
        if states.is_empty() {
            return Ok(Vec::new());
        }
        self.read_logits(states.len())
    }
}

fn two_mut<T>(v: &mut [T], a: usize, b: usize) -> (&T, &mut T) {
    if a < b {
        let (l, r) = v.split_at_mut(b);
        (&l[a], &mut r[0])
    } else {
        let (l, r) = v.split_at_mut(a);
        (&r[0], &mut l[b])
    }
}

fn cfg(gx: u32, gy: u32, threads: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (gx, gy, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    }
}

/// A kernel parameter as `cuLaunchKernelEx` takes it: a pointer to the value.
fn arg<T>(value: &T) -> *mut c_void {
    value as *const T as *mut c_void
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_slots_fit_the_free_memory_only_when_the_batch_was_not_asked_for() {
        let gb = 1usize << 30;
        let opts = |fit_sequences| CudaOptions {
            max_context: 32768,
            max_sequences: 32,
            spare_sequences: 0,
            fit_sequences,
            use_graphs: true,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            fold_router: true,
        };
        assert_eq!(sequence_slots(&opts(false), gb, 40 * gb).unwrap(), 32);
        assert_eq!(sequence_slots(&opts(true), gb, 40 * gb).unwrap(), 32);
        // 12 GiB free: 10 slots leave the reserve.
        assert_eq!(sequence_slots(&opts(true), gb, 12 * gb).unwrap(), 10);
        let asked = sequence_slots(&opts(false), gb, 12 * gb).unwrap_err();
        assert!(format!("{asked}").contains("--max-batch"), "{asked}");
        // One slot is still tried where it fits beside less than the reserve...
        assert_eq!(sequence_slots(&opts(true), gb, gb + gb / 2).unwrap(), 1);
        // ...and refused, naming what to change, where it does not fit at all.
        let none = sequence_slots(&opts(true), gb, gb / 2).unwrap_err();
        assert!(format!("{none}").contains("--context"), "{none}");
    }

    /// Without the NVIDIA driver (the CPU-only machines CI runs on), starting the backend is an
    /// error that says so rather than cudarc's panic. Where the driver is installed there is
    /// nothing to check here.
    #[test]
    fn a_missing_driver_is_an_error_not_a_panic() {
        // SAFETY: only opens (and closes) the shared library by its possible names.
        if unsafe { cudarc::driver::sys::is_culib_present() } {
            return;
        }
        let config = crate::model::demo::demo_config_json().to_string();
        let config = ModelConfig::from_json_str(&config).unwrap();
        let opts = CudaOptions {
            max_context: 64,
            max_sequences: 1,
            spare_sequences: 0,
            fit_sequences: false,
            use_graphs: true,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            fold_router: true,
        };
        let Err(err) = CudaBackend::synthetic(&config, WeightFormat::Bf16, opts) else {
            panic!("a CUDA backend started without the driver");
        };
        assert!(
            format!("{err:#}").contains("no NVIDIA driver found"),
            "{err:#}"
        );
    }
}

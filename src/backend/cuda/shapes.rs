//! Launch shapes of the CUDA kernels: the constants mirrored from the kernel sources, the model
//! dimensions the kernels take as arguments (or have compiled in: `shape_defines`), and how each
//! launch's grid, block and shared memory follow from the model's shapes and the device.
//! Plain functions of the configuration, tested without a GPU.

use cudarc::driver::DeviceRepr;

use super::weights::WeightFormat;
use crate::config::ModelConfig;

/// Threads of a mat-vec block (8 warps); also of the MoE blocks.
pub(super) const MATVEC_THREADS: u32 = 256;
/// Resident `matvec` blocks per SM (its launch bounds allow three): one wave of persistent blocks.
pub(super) const MATVEC_BLOCKS_PER_SM: usize = 3;
/// Most tokens a `matvec_tokens` block dots each weight row with (MATVEC_TOKENS in matvec.cu).
pub(super) const MATVEC_TOKENS: usize = 4;
/// Passes of the one-token grid over a quantised matrix above which two tokens take
/// `matvec_mma` instead of `matvec_tokens` (see `matvec_tokens_per_block`).
pub(super) const MATVEC_TOKENS_MAX_PASSES: usize = 4;
/// Tokens per tile of the `matvec_mma` kernels (MMA_TOKENS in matvec.cu, the mma's n); their
/// blocks take 1, 2 or 4 tiles (`matvec_mma`, `matvec_mma_16`, `matvec_mma_32`).
pub(super) const MMA_TOKENS: usize = 8;
pub(super) const MMA_MOST_TILES: usize = 4;
/// Intermediate rows (gate and up each) per warp of `moe_gate_up` (GATE_UP_ROWS_PER_WARP).
pub(super) const GATE_UP_ROWS_PER_WARP: usize = 2;
/// Output rows per warp of `moe_down` (DOWN_ROWS_PER_WARP).
pub(super) const DOWN_ROWS_PER_WARP: usize = 1;
/// Most tokens a block of `moe_gate_up_tokens` takes (MOE_TOKENS_PER_BLOCK).
pub(super) const MOE_TOKENS_PER_BLOCK: usize = 8;
/// Most context splits of attention decode (flash-decoding); a split covers whole rounds of its
/// warps' tiles, at least 128 positions. A step takes at most `decode_attention_splits`.
pub(super) const ATTENTION_SPLITS: usize = 256;
/// Warps of an `attention_split` block (DECODE_WARPS), each with its own tiles of positions:
/// eight rather than four halve the splits the combine merges (docs/BENCHMARKS.md).
pub(super) const ATTENTION_WARPS: usize = 8;
/// Positions of an `attention_split` warp tile (DECODE_TILE): its keys and values are staged in
/// shared memory as bf16.
pub(super) const ATTENTION_TILE: usize = 16;
/// Query heads of an `attention_split` block (DECODE_HEADS).
pub(super) const ATTENTION_HEADS: usize = 8;
/// Head dims per `attention_combine` block (COMBINE_DIMS) and threads per dim (COMBINE_PARTS).
pub(super) const COMBINE_DIMS: usize = 64;
pub(super) const COMBINE_PARTS: usize = 8;
/// Dynamic shared memory the staging kernels may use.
pub(super) const MAX_DYNAMIC_SHARED_BYTES: usize = 200 * 1024;
/// Threads of a row's `sample_finish` block (SAMPLE_THREADS in sample.cu).
pub(super) const SAMPLE_THREADS: u32 = 1024;
/// Threads of a `sample_scan` block (SAMPLE_SCAN_THREADS).
pub(super) const SAMPLE_SCAN_THREADS: u32 = 256;
/// Candidates a `sample_scan` block keeps for a filtered draw (SAMPLE_CANDIDATES).
pub(super) const SAMPLE_CANDIDATES: usize = 64;
/// Most `sample_scan` blocks per row (SAMPLE_MAX_BLOCKS): `sample_finish` holds all their
/// candidates in registers, SAMPLE_MAX_BLOCKS * SAMPLE_CANDIDATES / SAMPLE_THREADS per thread.
pub(super) const SAMPLE_MAX_BLOCKS: usize = 128;
/// Largest slice of a `sample_scan` block: its logits' keys are held in dynamic shared memory,
/// which stays under the 48 KB a launch may take without opting in (beside its static arrays).
pub(super) const SAMPLE_MAX_SLICE: usize = 10 * 1024;

/// Consecutive ids dealt to one `sample_scan` block (SAMPLE_RUN): a row goes to the blocks in
/// runs of this many, run r to block r % blocks (`slice_token` in sample.cu).
pub(super) const SAMPLE_RUN: usize = 8;

/// The most logits a `sample_scan` block takes of a vocabulary of `vocab` (its slice), and the
/// blocks per row: SAMPLE_MAX_BLOCKS slices, each at least 256 logits, so that a small
/// vocabulary still leaves each block more than its candidates; `None` when a vocabulary is too
/// large for the blocks' shared memory (over 1.3M).
pub(super) fn sample_slices(vocab: usize) -> Option<(usize, usize)> {
    let runs = vocab.div_ceil(SAMPLE_RUN);
    let slice = (runs.div_ceil(SAMPLE_MAX_BLOCKS) * SAMPLE_RUN)
        .max(256)
        .next_multiple_of(32);
    let blocks = runs.div_ceil(slice / SAMPLE_RUN).max(1);
    (slice <= SAMPLE_MAX_SLICE).then_some((slice, blocks))
}
/// Blocks of the first argmax pass.
pub(super) const ARGMAX_BLOCKS: usize = 256;

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct DeltaNetDims {
    key_heads: i32,
    value_heads: i32,
    key_dim: i32,
    value_dim: i32,
    kernel: i32,
    splits: i32,
    eps: f32,
}

/// State rows per thread of `deltanet_step` (MAX_ROWS_PER_THREAD) and most taps of its conv
/// (MAX_CONV_KERNEL).
pub(super) const DELTANET_MAX_ROWS_PER_THREAD: usize = 16;
pub(super) const DELTANET_MAX_CONV_KERNEL: usize = 4;

/// How `deltanet_step` spreads a head's [key_dim, value_dim] state: a cluster of `splits` blocks
/// owning value_dim / splits columns each, `threads` threads per block that each own a slice of
/// one column's rows (at most DELTANET_MAX_ROWS_PER_THREAD); conv kernels of at most
/// DELTANET_MAX_CONV_KERNEL taps; at most 4 blocks per head (MAX_SPLITS).
pub(super) struct DeltaNetShape {
    pub(super) splits: usize,
    pub(super) threads: usize,
    pub(super) smem: usize,
}

impl DeltaNetShape {
    pub(super) fn of(c: &ModelConfig) -> Option<Self> {
        let (kd, vd) = (c.linear_key_head_dim, c.linear_value_head_dim);
        let splits = [4, 2, 1]
            .into_iter()
            .find(|&s| vd.is_multiple_of(s) && (vd / s >= 8 || s == 1))?;
        let cols = vd / splits;
        let rows = (kd * cols / 256).max(1);
        let threads = cols * kd / rows;
        // Each thread convolves at most two of the block's 2 * key_dim + cols channels.
        let fits = kd.is_multiple_of(rows)
            && rows <= DELTANET_MAX_ROWS_PER_THREAD
            && threads <= 256
            && 2 * kd + cols <= 2 * threads
            && (1..=DELTANET_MAX_CONV_KERNEL).contains(&c.linear_conv_kernel_dim);
        (fits && threads.is_multiple_of(32)).then_some(Self {
            splits,
            threads,
            smem: (2 * kd + cols + threads + 64) * 4,
        })
    }
}

/// The model's shapes compiled into the kernel modules whose kernels read them, and the format
/// of its expert matrices where they all share one (`experts`): (module, defines). The kernels
/// take the same dimensions and formats as arguments too, and use those where nothing is
/// compiled in (`lily kernels --check` compiles both).
pub(super) fn shape_defines(
    c: &ModelConfig,
    experts: Option<WeightFormat>,
) -> Vec<(&'static str, Vec<String>)> {
    vec![
        ("deltanet", deltanet_shape_defines(c)),
        ("moe", moe_shape_defines(c, experts)),
    ]
}

/// `NAME=VALUE` compile defines.
pub(super) fn defines(values: &[(&str, usize)]) -> Vec<String> {
    values
        .iter()
        .map(|(name, value)| format!("{name}={value}"))
        .collect()
}

/// Defines that compile the model's MoE dimensions into the `moe` module (`moe_shape` in
/// moe.cu) and the shapes of its weights (`moe_weight`): the routing's loops and the experts'
/// row arithmetic fold to constants. At full size the dimensions took batch-1 decode from 731
/// to 748 tok/s (`moe_router_shared` 3.35 -> 3.17 us and `moe_down` 5.42 -> 5.28 us per launch
/// on the critical path), the weights' shapes from 744-748 to 758-762. The experts' format, where
/// every expert matrix shares one, leaves the kernels only that format's path (`expert_weight`):
/// fewer instructions and registers (`moe_router_shared` 98 -> 80), 758-762 -> 767-770 tok/s.
pub(super) fn moe_shape_defines(c: &ModelConfig, experts: Option<WeightFormat>) -> Vec<String> {
    let format = match experts {
        Some(WeightFormat::Affine { bits, group }) => vec![
            ("MOE_BITS", bits),
            ("MOE_GROUP_SHIFT", group.trailing_zeros() as usize),
        ],
        // Dense rows have no groups.
        Some(WeightFormat::Bf16) => vec![("MOE_BITS", 16), ("MOE_GROUP_SHIFT", 0)],
        None => Vec::new(),
    };
    defines(
        &[
            ("MOE_EXPERTS", c.num_experts),
            ("MOE_TOP_K", c.num_experts_per_tok),
            ("MOE_INTERMEDIATE", c.moe_intermediate_size),
            ("MOE_SHARED_INTERMEDIATE", c.shared_expert_intermediate_size),
            ("MOE_HIDDEN", c.hidden_size),
        ]
        .into_iter()
        .chain(format)
        .collect::<Vec<_>>(),
    )
}

/// Defines that compile the model's DeltaNet shape into the `deltanet` module (`deltanet_shape`
/// in deltanet.cu), so that the step's index arithmetic folds to constants: at full size that
/// took `deltanet_step` from 6.6 to 3.9 us per launch on the decode critical path. None for a
/// shape the kernels do not take (the backend refuses it).
pub(super) fn deltanet_shape_defines(c: &ModelConfig) -> Vec<String> {
    let Some(gdn) = DeltaNetShape::of(c) else {
        return Vec::new();
    };
    defines(&[
        ("GDN_KEY_HEADS", c.linear_num_key_heads),
        ("GDN_VALUE_HEADS", c.linear_num_value_heads),
        ("GDN_KEY_DIM", c.linear_key_head_dim),
        ("GDN_VALUE_DIM", c.linear_value_head_dim),
        ("GDN_CONV_KERNEL", c.linear_conv_kernel_dim),
        ("GDN_SPLITS", gdn.splits),
        ("GDN_STEP_THREADS", gdn.threads),
    ])
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct AttentionDims {
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    rotary_dim: i32,
    max_context: i32,
    pub(super) splits: i32,
    eps: f32,
    rope_theta: f32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct MoeDims {
    experts: i32,
    top_k: i32,
    intermediate: i32,
    shared_intermediate: i32,
    hidden: i32,
    eps: f32,
}

impl DeltaNetDims {
    pub(super) fn new(c: &ModelConfig, splits: usize) -> Self {
        Self {
            key_heads: c.linear_num_key_heads as i32,
            value_heads: c.linear_num_value_heads as i32,
            key_dim: c.linear_key_head_dim as i32,
            value_dim: c.linear_value_head_dim as i32,
            kernel: c.linear_conv_kernel_dim as i32,
            splits: splits as i32,
            eps: c.rms_norm_eps,
        }
    }
}

impl AttentionDims {
    pub(super) fn new(c: &ModelConfig, max_context: usize, splits: usize) -> Self {
        Self {
            heads: c.num_attention_heads as i32,
            kv_heads: c.num_key_value_heads as i32,
            head_dim: c.head_dim as i32,
            rotary_dim: c.rotary_dim as i32,
            max_context: max_context as i32,
            splits: splits as i32,
            eps: c.rms_norm_eps,
            rope_theta: c.rope_theta as f32,
        }
    }
}

impl MoeDims {
    pub(super) fn new(c: &ModelConfig) -> Self {
        Self {
            experts: c.num_experts as i32,
            top_k: c.num_experts_per_tok as i32,
            intermediate: c.moe_intermediate_size as i32,
            shared_intermediate: c.shared_expert_intermediate_size as i32,
            hidden: c.hidden_size as i32,
            eps: c.rms_norm_eps,
        }
    }
}

/// Blocks of `attention_split` per context split: each KV head's query heads in tiles of
/// ATTENTION_HEADS.
pub(super) fn attention_split_blocks_per_split(c: &ModelConfig) -> usize {
    c.num_key_value_heads
        * (c.num_attention_heads / c.num_key_value_heads).div_ceil(ATTENTION_HEADS)
}

/// Dynamic shared memory of `attention_split`: per warp a key and a value tile of ATTENTION_TILE
/// rows (`attention_tile_row` bf16 each).
pub(super) fn attention_split_smem(head_dim: usize) -> u32 {
    (ATTENTION_WARPS * 2 * ATTENTION_TILE * attention_tile_row(head_dim) * 2) as u32
}

/// Most context splits of attention decode on a GPU of `num_sms` SMs that each hold `per_sm`
/// `attention_split` blocks (the occupancy the driver reports): as many splits as leave every
/// block resident at once (each KV head's query tiles take a block per split), so that a long
/// context's splits run in one wave of blocks, each taking more of the context's tiles, rather
/// than in two; at most ATTENTION_SPLITS.
pub(super) fn decode_attention_splits(c: &ModelConfig, num_sms: usize, per_sm: usize) -> usize {
    let blocks = attention_split_blocks_per_split(c).max(1);
    (num_sms * per_sm.max(1) / blocks).clamp(1, ATTENTION_SPLITS)
}

/// bf16 per shared-memory row of the attention kernels' key/value (and query) tiles: head_dim
/// rounded up to the width they are instantiated for (32, 64, 128 or 256; construction checks
/// that head_dim is at most 256), then 8 of padding (DECODE_ROW_PAD, PREFILL_ROW_PAD), so that
/// the 8 rows one ldmatrix reads fall in distinct banks.
pub(super) fn attention_tile_row(head_dim: usize) -> usize {
    let width = [32, 64, 128, 256]
        .into_iter()
        .find(|&w| head_dim <= w)
        .unwrap_or(256);
    width + 8
}

/// Floats per slot of a token's MoE activations (routed experts' and the shared expert's side
/// by side: `act_width` in moe.cu is top_k + 1 of them).
pub(super) fn moe_slot_width(c: &ModelConfig) -> usize {
    c.moe_intermediate_size
        .max(c.shared_expert_intermediate_size)
}

/// Shared memory `moe_down` stages its inputs in: the routed activations one after another,
/// then the shared expert's.
pub(super) fn moe_down_staged_bytes(c: &ModelConfig) -> u32 {
    staged_bytes(&[
        c.moe_intermediate_size * c.num_experts_per_tok,
        c.shared_expert_intermediate_size,
    ])
}

/// Dynamic shared memory `moe_down` asks for: its staging, and at least a third of an SM's
/// (`smem_per_sm`), so that no more than two of its blocks share an SM. They are placed as
/// `moe_gate_up`'s blocks leave, and without the floor they pile three to an SM where room
/// appears first (`lily bench --trace`: 71 SMs with three, 36 with none), and those SMs finish
/// ~0.5 us later.
pub(super) fn moe_down_smem(c: &ModelConfig, smem_per_sm: u32) -> u32 {
    moe_down_staged_bytes(c)
        .max(smem_per_sm / 3)
        .min(MAX_DYNAMIC_SHARED_BYTES as u32)
}

/// Warps of a one-token `moe_gate_up` block (GATE_UP_WARPS in moe.cu) where its module is
/// compiled for experts of `format`: 16 for 4-bit experts, whose blocks then hold 32
/// intermediates, a whole chunk of `moe_down`'s staged input (`moe_stages_act`); 8 otherwise
/// (the 8-bit and bf16 paths spill at 16 warps under the register cap that keeps a `moe_down`
/// block beside one, and decoded 3.7% slower).
pub(super) fn gate_up_warps(format: Option<WeightFormat>) -> usize {
    match format {
        Some(WeightFormat::Affine { bits: 4, .. }) => 16,
        _ => 8,
    }
}

/// Row blocks of one token's `moe_gate_up` grid (its x dimension; y is the routed slot), for a
/// module compiled for experts of `format`.
pub(super) fn gate_up_row_blocks(c: &ModelConfig, format: Option<WeightFormat>) -> usize {
    c.moe_intermediate_size
        .div_ceil(gate_up_warps(format) * GATE_UP_ROWS_PER_WARP)
}

/// Router rows per block of `out_proj_route`'s folded router (`FOLD_ROWS` in moe.cu).
pub(super) const FOLD_ROWS: usize = 2;

/// Router rows per block of `fold_router`, which makes the folded router at load
/// (`FOLD_TILE` in moe.cu).
pub(super) const FOLD_TILE: usize = 8;

/// Bytes of shared memory the shared expert's slice takes after the staged input in one
/// token's `moe_gate_up` with the router folded (`SharedSlice` in moe.cu), for experts of
/// `format` and a grid of `blocks` blocks: the gate and up rows of `per` intermediates, their
/// scales and biases (quantised) and their 2 * per results.
pub(super) fn shared_slice_bytes(c: &ModelConfig, format: WeightFormat, blocks: usize) -> usize {
    let per = c.shared_expert_intermediate_size.div_ceil(blocks.max(1));
    let h = c.hidden_size;
    let (bits, scale_bytes) = match format {
        WeightFormat::Bf16 => (16, 0),
        WeightFormat::Affine { bits, group } => {
            (bits, (2 * per * (h / group) * 2).next_multiple_of(16))
        }
    };
    2 * per * (h * bits / 8) + 2 * scale_bytes + 2 * per * 4
}

/// Whether one token's `moe_gate_up` writes `moe_down`'s routed input already staged
/// (`stage_block_act` in moe.cu), for a module compiled for experts of `format`: 4-bit experts
/// (16-warp blocks of 32 intermediates, one 32-value chunk of the staged layout) whose
/// intermediate size is whole chunks.
pub(super) fn moe_stages_act(c: &ModelConfig, format: Option<WeightFormat>) -> bool {
    gate_up_warps(format) * GATE_UP_ROWS_PER_WARP == 32
        && c.moe_intermediate_size.is_multiple_of(32)
}

/// Floats a staged input of `cols` values takes for `bits`-bit weights (`staged_floats_bits` in
/// rowdot.cuh): what each token's input takes in the batched MoE kernels.
pub(super) fn staged_floats_bits(cols: usize, bits: usize) -> usize {
    let floats = match bits {
        4 => cols / 2 + cols / 16,
        8 => cols / 2 + cols / 8,
        _ => cols,
    };
    floats.next_multiple_of(4)
}

/// How `moe_gate_up_tokens` splits `tokens` over grid rows: (tokens per block, rows). A block
/// takes at most MOE_TOKENS_PER_BLOCK, and at most as many as `budget` bytes of shared memory
/// stage at `per_token` bytes each; the tokens are spread evenly over the rows.
pub(super) fn moe_token_blocks(tokens: usize, per_token: usize, budget: usize) -> (usize, usize) {
    let most = (budget / per_token.max(1)).clamp(1, MOE_TOKENS_PER_BLOCK);
    let rows = tokens.div_ceil(most);
    (tokens.div_ceil(rows), rows)
}

/// Rows a mat-vec warp dots per pass for rows of `cols` values of `bits` bits: two
/// (`matvec_two_rows`, two 16-byte chunks of each per lane) when a row is at most 64 chunks, so
/// that short rows do not leave half the lanes idle; else one (`matvec`, four chunks per lane).
pub(super) fn matvec_rows_per_warp(cols: usize, bits: usize) -> usize {
    if cols.div_ceil(128 / bits) <= 64 {
        2
    } else {
        1
    }
}

/// Dynamic shared memory of a `matvec_tokens` block of `tokens` inputs of `cols` values: the
/// first rows of y (MATVEC_TOKENS x 2 floats per warp), then each token's staging.
pub(super) fn matvec_tokens_smem(cols: usize, tokens: usize) -> u32 {
    (MATVEC_THREADS as usize / 32 * MATVEC_TOKENS * 2 * 4) as u32
        + tokens as u32 * staged_bytes(&[cols])
}

/// Whether `matvec_mma` takes weights of `bits` bits in groups of `group`, rows of `cols`: 4-
/// or 8-bit, each 16-byte chunk of a row inside one group, rows of whole quads of chunks, and
/// its staging within the shared memory it may use.
pub(super) fn mma_takes(bits: usize, group: usize, cols: usize) -> bool {
    (bits == 4 || bits == 8)
        && group >= 128 / bits
        && cols.is_multiple_of(512 / bits)
        && mma_smem(cols, 1) as usize <= MAX_DYNAMIC_SHARED_BYTES
}

/// Dynamic shared memory of a `matvec_mma` block of `block_tiles` tiles for rows of `cols`
/// inputs: MMA_TOKENS rows of cols + 4 halves per tile, then the tokens' scales (32 floats),
/// then the slices' sums (a float4 per lane of 8 warps per tile).
pub(super) fn mma_smem(cols: usize, block_tiles: usize) -> u32 {
    (block_tiles * MMA_TOKENS * (cols + 4) * 2 + (32 + block_tiles * 8 * 32 * 4) * 4) as u32
}

/// Tiles of MMA_TOKENS tokens per `matvec_mma` block for `tokens` rows of `cols` inputs: enough
/// for all of them (each weight row is then read once), at most MMA_MOST_TILES, fewer where
/// their staging would not fit in shared memory.
pub(super) fn mma_block_tiles(tokens: usize, cols: usize) -> usize {
    let mut tiles = tokens
        .div_ceil(MMA_TOKENS)
        .next_power_of_two()
        .min(MMA_MOST_TILES);
    while tiles > 1 && mma_smem(cols, tiles) as usize > MAX_DYNAMIC_SHARED_BYTES {
        tiles /= 2;
    }
    tiles
}

/// `matvec_mma`'s tiles of 16 rows of a `rows` x `cols` matrix of `bits` bits and the warps that
/// share each (1, 2, 4 or 8): the fewest that give `warps` warps work, each slice whole quads of
/// 16-byte chunks.
pub(super) fn mma_split(rows: usize, cols: usize, bits: usize, warps: usize) -> (usize, usize) {
    let tiles = rows.div_ceil(16);
    let chunks = cols * bits / 128;
    let allowed: Vec<usize> = [1, 2, 4, 8]
        .into_iter()
        .take_while(|&k| chunks.is_multiple_of(4 * k))
        .collect();
    let ksplit = allowed
        .iter()
        .copied()
        .find(|&k| tiles * k >= warps)
        .or(allowed.last().copied())
        .unwrap_or(1);
    (tiles, ksplit)
}

/// Dynamic shared memory of a kernel that stages inputs of the given widths (`staged_floats` in
/// rowdot.cuh: the input, chunk sums and a scale), after 64 floats of reduction scratch.
pub(super) fn staged_bytes(widths: &[usize]) -> u32 {
    let floats: usize = widths
        .iter()
        .map(|&c| c + (c / 8 + 4).next_multiple_of(4))
        .sum();
    ((64 + floats) * 4) as u32
}

// SAFETY: plain old data mirroring the structs of the same names in the kernel sources.
unsafe impl DeviceRepr for DeltaNetDims {}
unsafe impl DeviceRepr for AttentionDims {}
unsafe impl DeviceRepr for MoeDims {}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> ModelConfig {
        ModelConfig::from_json_str(text).expect("config parses")
    }

    /// Qwen3.6-35B-A3B's configuration.
    fn full_size() -> ModelConfig {
        config(include_str!("../../../configs/qwen3.6-35b-a3b.json"))
    }

    fn with_linear_dims(key_dim: usize, value_dim: usize) -> ModelConfig {
        let mut c = full_size();
        c.linear_key_head_dim = key_dim;
        c.linear_value_head_dim = value_dim;
        c
    }

    #[test]
    fn sample_slices_cover_the_vocabulary_in_at_most_the_most_blocks() {
        // Qwen3.6's padded vocabulary: 128 slices of 1,952 logits.
        assert_eq!(sample_slices(248_320), Some((1_952, 128)));
        // Small vocabularies keep slices of 256, so that a block has more than its candidates.
        assert_eq!(sample_slices(1_024), Some((256, 4)));
        assert_eq!(sample_slices(275), Some((256, 2)));
        assert_eq!(sample_slices(1), Some((256, 1)));
        for vocab in [1, 255, 256, 257, 32_768, 151_936, 248_044, 1_000_000] {
            let (slice, blocks) = sample_slices(vocab).unwrap();
            assert!(blocks <= SAMPLE_MAX_BLOCKS, "{vocab}");
            // Dealt in runs, run r to block r % blocks: the first block holds the most runs,
            // and it must fit its slice; the last block must hold one.
            let runs = vocab.div_ceil(SAMPLE_RUN);
            assert!(
                runs.div_ceil(blocks) * SAMPLE_RUN <= slice,
                "{vocab}: a block's runs overflow its slice"
            );
            assert!(runs >= blocks, "{vocab}: an empty slice");
        }
        assert_eq!(
            sample_slices(SAMPLE_MAX_BLOCKS * SAMPLE_MAX_SLICE + 1),
            None
        );
    }

    #[test]
    fn batched_moe_blocks_spread_tokens_evenly_within_the_shared_memory_budget() {
        assert_eq!(moe_token_blocks(1, 100, 10_000), (1, 1));
        assert_eq!(moe_token_blocks(8, 100, 10_000), (8, 1));
        assert_eq!(moe_token_blocks(10, 100, 10_000), (5, 2));
        assert_eq!(moe_token_blocks(32, 100, 10_000), (8, 4));
        // Three fit the budget: four rows, of at most three tokens each.
        assert_eq!(moe_token_blocks(10, 300, 1_000), (3, 4));
        // Not even one fits: one each (the launch then asks for more than the budget).
        assert_eq!(moe_token_blocks(5, 2_000, 1_000), (1, 5));
        // The full-size model's 4-bit staging: 8 tokens in one row of two blocks per SM.
        let c = full_size();
        let gate_up = 4 * staged_floats_bits(c.hidden_size, 4);
        assert_eq!(gate_up, 4 * (1024 + 128));
        assert_eq!(moe_token_blocks(8, gate_up, 114 * 1024), (8, 1));
        // 8-bit: int16 inputs (two a float) and an (xscale, csum) pair per 16 of them.
        assert_eq!(staged_floats_bits(2048, 8), 1024 + 256);
        assert_eq!(staged_floats_bits(2048, 16), 2048);
    }

    #[test]
    fn only_4_bit_experts_have_moe_down_input_staged_by_gate_up() {
        let q4 = Some(WeightFormat::Affine { bits: 4, group: 64 });
        let q8 = Some(WeightFormat::Affine { bits: 8, group: 64 });
        // A 4-bit module's blocks hold 32 intermediates: one 4-bit chunk.
        assert_eq!(gate_up_warps(q4) * GATE_UP_ROWS_PER_WARP, 32);
        let mut c = config(include_str!("../../../configs/qwen3.6-35b-a3b.json"));
        assert!(moe_stages_act(&c, q4));
        for other in [q8, Some(WeightFormat::Bf16), None] {
            assert_eq!(gate_up_warps(other), 8);
            assert!(!moe_stages_act(&c, other));
        }
        // A slot of 48 intermediates ends mid-chunk.
        c.moe_intermediate_size = 48;
        assert!(!moe_stages_act(&c, q4));
    }

    #[test]
    fn decode_attention_splits_fill_one_wave_of_blocks() {
        // The full-size model on the H200 (132 SMs, one block per SM: 135 KB of tiles and 158
        // registers a thread), 2 KV heads of 8 query heads each: 66 splits, 132 blocks.
        let c = full_size();
        assert_eq!(decode_attention_splits(&c, 132, 1), 66);
        // 16 query heads per KV head (two tiles of eight), three blocks per SM: 132 * 3 / (2 * 2).
        let mut wide = c.clone();
        wide.num_attention_heads = 32;
        assert_eq!(decode_attention_splits(&wide, 132, 3), 99);
        // At most ATTENTION_SPLITS, and at least one, whatever the occupancy.
        wide.num_key_value_heads = 1;
        wide.num_attention_heads = 8;
        assert_eq!(decode_attention_splits(&wide, 1000, 1), ATTENTION_SPLITS);
        wide.num_key_value_heads = 64;
        wide.num_attention_heads = 1024;
        assert_eq!(decode_attention_splits(&wide, 8, 0), 1);
    }

    #[test]
    fn short_rows_go_two_per_warp_pass() {
        // The hidden size at 4 bits (in_proj, qkv, lm_head): 64 chunks of 32 values.
        assert_eq!(matvec_rows_per_warp(2048, 4), 2);
        // out_proj's 4,096 inputs, and bf16 rows of 2,048 (256 chunks of 8 values).
        assert_eq!(matvec_rows_per_warp(4096, 4), 1);
        assert_eq!(matvec_rows_per_warp(2048, 16), 1);
        assert_eq!(matvec_rows_per_warp(1024, 8), 2);
        assert_eq!(matvec_rows_per_warp(1032, 8), 1);
    }

    #[test]
    fn deltanet_heads_split_over_clusters_of_four_at_full_size() {
        let shape = DeltaNetShape::of(&with_linear_dims(128, 128)).expect("supported");
        // 4 blocks of 32 columns; 256 threads own 16 rows each of one column.
        assert_eq!((shape.splits, shape.threads), (4, 256));
        assert_eq!(shape.smem, (2 * 128 + 32 + 256 + 64) * 4);
    }

    #[test]
    fn the_full_size_shapes_are_compiled_into_their_modules() {
        let c = full_size();
        assert_eq!(
            deltanet_shape_defines(&c),
            [
                "GDN_KEY_HEADS=16",
                "GDN_VALUE_HEADS=32",
                "GDN_KEY_DIM=128",
                "GDN_VALUE_DIM=128",
                "GDN_CONV_KERNEL=4",
                "GDN_SPLITS=4",
                "GDN_STEP_THREADS=256",
            ]
        );
        // A shape the step cannot take compiles nothing in (and the backend refuses it).
        assert!(deltanet_shape_defines(&with_linear_dims(256, 128)).is_empty());
        let modules: Vec<_> = shape_defines(&c, None)
            .into_iter()
            .map(|(m, _)| m)
            .collect();
        assert_eq!(modules, ["deltanet", "moe"]);
        let dims = [
            "MOE_EXPERTS=256",
            "MOE_TOP_K=8",
            "MOE_INTERMEDIATE=512",
            "MOE_SHARED_INTERMEDIATE=512",
            "MOE_HIDDEN=2048",
        ];
        // Experts of mixed formats: the dimensions alone.
        assert_eq!(moe_shape_defines(&c, None), dims);
        let q4 = WeightFormat::Affine { bits: 4, group: 64 };
        assert_eq!(
            moe_shape_defines(&c, Some(q4)),
            [&dims[..], &["MOE_BITS=4", "MOE_GROUP_SHIFT=6"]].concat()
        );
        let q8 = WeightFormat::Affine {
            bits: 8,
            group: 128,
        };
        assert_eq!(
            moe_shape_defines(&c, Some(q8))[dims.len()..],
            ["MOE_BITS=8", "MOE_GROUP_SHIFT=7"]
        );
        assert_eq!(
            moe_shape_defines(&c, Some(WeightFormat::Bf16))[dims.len()..],
            ["MOE_BITS=16", "MOE_GROUP_SHIFT=0"]
        );
        // The family's largest model: four value heads per key head, 512 experts, top-10.
        let large = config(include_str!("../../../configs/qwen3.5-397b-a17b.json"));
        assert_eq!(deltanet_shape_defines(&large)[1], "GDN_VALUE_HEADS=64");
        assert_eq!(
            deltanet_shape_defines(&large)[2..],
            deltanet_shape_defines(&c)[2..]
        );
        assert_eq!(
            moe_shape_defines(&large, Some(q4)),
            [
                "MOE_EXPERTS=512",
                "MOE_TOP_K=10",
                "MOE_INTERMEDIATE=1024",
                "MOE_SHARED_INTERMEDIATE=1024",
                "MOE_HIDDEN=4096",
                "MOE_BITS=4",
                "MOE_GROUP_SHIFT=6",
            ]
        );
    }

    #[test]
    fn deltanet_shapes_of_the_test_fixtures_use_clusters() {
        for dir in ["tiny-wrapper", "tiny-text", "scripted"] {
            let path = format!(
                "{}/tests/fixtures/{dir}/config.json",
                env!("CARGO_MANIFEST_DIR")
            );
            let c = config(&std::fs::read_to_string(&path).expect("fixture config"));
            let shape = DeltaNetShape::of(&c).expect("fixture supported");
            assert!(
                shape.splits > 1,
                "{dir}: the GPU checks should exercise the cluster path"
            );
            let cols = c.linear_value_head_dim / shape.splits;
            assert!(cols >= 8 && shape.threads.is_multiple_of(32), "{dir}");
            assert!(
                2 * c.linear_key_head_dim + cols <= 2 * shape.threads,
                "{dir}"
            );
        }
    }

    #[test]
    fn deltanet_shapes_the_kernel_cannot_hold_are_refused() {
        // 32 state rows per thread exceed MAX_ROWS_PER_THREAD.
        assert!(DeltaNetShape::of(&with_linear_dims(256, 128)).is_none());
        // 3 columns cannot make whole warps.
        assert!(DeltaNetShape::of(&with_linear_dims(4, 3)).is_none());
        // The conv keeps at most MAX_CONV_KERNEL taps (and its history) in registers.
        let mut c = with_linear_dims(128, 128);
        for taps in [1, DELTANET_MAX_CONV_KERNEL] {
            c.linear_conv_kernel_dim = taps;
            assert!(DeltaNetShape::of(&c).is_some(), "{taps} taps");
        }
        for taps in [0, DELTANET_MAX_CONV_KERNEL + 1] {
            c.linear_conv_kernel_dim = taps;
            assert!(DeltaNetShape::of(&c).is_none(), "{taps} taps");
        }
    }

    #[test]
    fn tensor_core_mat_vec_splits_few_rows_over_more_warps() {
        // 2,112 warps on an H200 (132 SMs, two blocks of 8 warps each).
        let warps = 2112;
        // out_proj: 128 tiles of 16 rows, 128 chunks per row: 8 warps per tile.
        assert_eq!(mma_split(2048, 4096, 4, warps), (128, 8));
        // in_proj: 772 tiles, 64 chunks: 4 warps per tile.
        assert_eq!(mma_split(12352, 2048, 4, warps), (772, 4));
        // lm_head: enough tiles for every warp.
        assert_eq!(mma_split(248320, 2048, 4, warps), (15520, 1));
        // Slices stay whole quads of chunks: 8 chunks per row allow two slices at most.
        assert_eq!(mma_split(64, 256, 4, warps), (4, 2));
        assert!(mma_takes(4, 64, 4096));
        assert!(mma_takes(8, 32, 2048));
        assert!(!mma_takes(16, 0, 4096));
        assert!(!mma_takes(4, 64, 96));
        assert!(!mma_takes(4, 16, 2048));
    }

    #[test]
    fn tensor_core_mat_vec_blocks_take_every_token_their_staging_allows() {
        // Tiles of 8 tokens per block: all of the batch's, rounded up to 1, 2 or 4.
        assert_eq!(mma_block_tiles(2, 2048), 1);
        assert_eq!(mma_block_tiles(8, 2048), 1);
        assert_eq!(mma_block_tiles(9, 2048), 2);
        assert_eq!(mma_block_tiles(16, 2048), 2);
        assert_eq!(mma_block_tiles(17, 2048), 4);
        assert_eq!(mma_block_tiles(64, 2048), 4);
        // 32 tokens of 4,096 inputs would stage 262 KB: two tiles, two block rows.
        assert_eq!(mma_block_tiles(32, 4096), 2);
        for cols in [512, 2048, 4096, 6144] {
            for tokens in 2..=40 {
                let tiles = mma_block_tiles(tokens, cols);
                assert!(
                    mma_smem(cols, tiles) as usize <= MAX_DYNAMIC_SHARED_BYTES,
                    "{tokens} tokens of {cols}"
                );
            }
        }
        // One tile: rows of cols + 4 halves, 32 scales, a float4 per lane of 8 warps.
        assert_eq!(mma_smem(2048, 1), (8 * 2052 * 2 + (32 + 1024) * 4) as u32);
    }

    #[test]
    fn staging_reserves_the_widest_layout_after_the_scratch() {
        // 2048 inputs: the f32 layout (2048 floats) + 256 chunk sums + the 4-bit scale, rounded to
        // float4s, after 64 floats of scratch.
        assert_eq!(staged_bytes(&[2048]), (64 + 2048 + 260) * 4);
        assert_eq!(staged_bytes(&[512, 512]), staged_bytes(&[512]) * 2 - 64 * 4);
    }

    #[test]
    fn attention_split_tiles_fit_a_block_on_an_sm() {
        let full = attention_split_smem(256) as usize;
        assert_eq!(full, 8 * 2 * 16 * 264 * 2);
        assert!(full <= MAX_DYNAMIC_SHARED_BYTES);
        // An H200 SM has 228 KB of shared memory, 1 KB of it reserved per block, and the
        // kernel's static arrays take 2 KB.
        assert!(full + 1024 + 2048 <= 228 * 1024);
        assert_eq!(attention_split_smem(96), attention_split_smem(128));
        assert_eq!(attention_split_smem(32), 8 * 2 * 16 * 40 * 2);
    }
}

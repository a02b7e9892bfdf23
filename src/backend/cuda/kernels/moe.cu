// The sparse MoE block, decode, in three launches: the router logits together with the shared
// expert's gate/up (neither waits for the routing), then the routed experts' gate/up (each block
// routes: softmax over the router logits, top-k, renormalised, all on the GPU) with SwiGLU, then
// every slot's down projection, weighted and added to the residual stream.
//
// Programmatic dependent launch lets a kernel start while the previous one runs, and the
// previous one lets it start only once the kernel before that has finished: so moe_gate_up stages
// its input (the residual stream, last written by the mixer's output projection, two launches
// back) before waiting for the router logits.
//
// Several tokens (decode batches, prefill without tensor cores) take four launches: the same
// router launch, moe_route once per token, then moe_gate_up_tokens, whose blocks each take
// several tokens in turn, and moe_down with a grid row per token, which can request its routed
// rows before its wait (the routing is two launches back). Large decode batches of 4- or 8-bit
// experts send the routed experts through prefill's grouped products instead (each expert's
// weights read once for all its tokens) and the shared expert's down projection through
// matvec_mma (matvec.cu).
//
// Slots 0..top_k-1 are routed experts, slot top_k is the shared expert, whose weight is
// sigmoid(shared_expert_gate · x); moe_down folds each slot's weight into its staged
// activations.

#define MAX_TOP_K 32
#define MAX_EXPERTS 1024

struct MoeDims {
    int experts, top_k, intermediate, shared_intermediate, hidden;
    float eps;
};

// The MoE's dimensions, with the model's in place of `given` where they are compiled in
// (MOE_EXPERTS and the rest defined): index arithmetic and loop bounds then fold to constants.
__device__ __forceinline__ MoeDims moe_shape(MoeDims given) {
#ifdef MOE_EXPERTS
    given.experts = MOE_EXPERTS;
    given.top_k = MOE_TOP_K;
    given.intermediate = MOE_INTERMEDIATE;
    given.shared_intermediate = MOE_SHARED_INTERMEDIATE;
    given.hidden = MOE_HIDDEN;
#endif
    return given;
}

// w with the shape [rows, cols] the MoE's dimensions give it, where those are compiled in (the
// backend checks every MoE weight's shape against the config when it loads it): its row
// arithmetic then folds to constants as well.
__device__ __forceinline__ Weight moe_weight(Weight w, int rows, int cols) {
#ifdef MOE_EXPERTS
    w.rows = rows;
    w.cols = cols;
#endif
    return w;
}

// An expert matrix (routed or shared gate, up or down) as moe_weight, with the experts' format in
// place of its own where that is compiled in (MOE_BITS and MOE_GROUP_SHIFT defined: the backend
// checks that every expert matrix is stored so), so that the other formats' paths drop out of the
// kernels (fewer instructions, and registers allocated for this path alone).
__device__ __forceinline__ Weight expert_weight(Weight w, int rows, int cols) {
    w = moe_weight(w, rows, cols);
#ifdef MOE_BITS
    w.bits = MOE_BITS;
    w.group_shift = MOE_GROUP_SHIFT;
#endif
    return w;
}

// A sort key for (logit, expert): larger logits give larger keys, ties go to the lower id, and
// every valid key's upper half is above 0 (so padding_key(e) ranks below all of them).
__device__ __forceinline__ unsigned long long route_key(float v, int e) {
    const uint32_t u = __float_as_uint(v);
    const uint32_t ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)ordered << 32) | (0xffffffffu - (uint32_t)e);
}

// The logit a route_key was made of, bit for bit.
__device__ __forceinline__ float key_logit(unsigned long long key) {
    const uint32_t ordered = (uint32_t)(key >> 32);
    return __uint_as_float((ordered & 0x80000000u) ? (ordered & 0x7fffffffu) : ~ordered);
}

// The key of slot e >= experts of a run of 32: below every expert's and distinct, so that each
// padding slot of a short last run takes a rank of its own.
__device__ __forceinline__ unsigned long long padding_key(int e) { return 0xffffffffu - (uint32_t)e; }

// Unroll factors of rank_experts' two loops, settable by LILY_DEFINES: each block runs that code
// once, so it trades instructions executed against code fetched cold.
#ifndef RANK_RUN_UNROLL
#define RANK_RUN_UNROLL 8
#endif
#ifndef RANK_CANDIDATE_UNROLL
#define RANK_CANDIDATE_UNROLL 4
#endif

// Picks the top_k experts from `logits` (global or shared memory; entry `experts`, the shared
// expert's gate, is not read) into ids[0..top_k), their logits into chosen[0..top_k) (so that
// their weights need no second read of `logits`), and sets ids[top_k] = -1 (the shared expert);
// `keys` is shared scratch of 2 * MAX_EXPERTS entries. Called by every thread of the block
// (whole warps); ends synchronised. Ranks instead of top_k rounds of argmax: each run of 32
// experts keeps its own top min(top_k, 32) (a key's rank among the run's 32), then those
// candidates are ranked among themselves, and rank r is slot r. A candidate is ranked by `split`
// consecutive threads (as many as the block has to spare, up to 8), each comparing it with every
// split-th candidate: with 256 experts, top-8 and 256 threads, 16 comparisons per thread instead
// of 64 (this sits on the critical path of every moe_gate_up block).
__device__ void rank_experts(const MoeDims& d, const float* logits, unsigned long long* keys, int* ids,
                             float* chosen) {
    const int runs = (d.experts + 31) / 32, kept = min(d.top_k, 32);
    unsigned long long* candidates = keys + MAX_EXPERTS;
    for (int e = threadIdx.x; e < runs * 32; e += blockDim.x)
        keys[e] = e < d.experts ? route_key(logits[e], e) : padding_key(e);
    // Both loops give key e to thread e mod blockDim.x, so a run of 32 keys is stored and ranked
    // by the same warp (blockDim.x is whole warps): a warp barrier, whatever the expert count.
    __syncwarp();
    for (int e = threadIdx.x; e < runs * 32; e += blockDim.x) {
        const unsigned long long key = keys[e];
        const unsigned long long* run = keys + (e & ~31);
        int r = 0;
#pragma unroll RANK_RUN_UNROLL
        for (int j = 0; j < 32; ++j) r += run[j] > key;
        // Ranks are distinct (padding keys too), so every one of the run's `kept` slots is
        // written, by real keys first.
        if (r < kept) candidates[(e >> 5) * kept + r] = key;
    }
    __syncthreads();
    const int count = runs * kept;
    int shift = 0;
    while (shift < 3 && (2 << shift) * count <= (int)blockDim.x) ++shift;
    const int split = 1 << shift, part = threadIdx.x & (split - 1);
    // A block-uniform trip count: the shuffles below need every lane.
    for (int base = 0; base < count; base += (int)blockDim.x >> shift) {
        const int i = base + (threadIdx.x >> shift);
        const unsigned long long key = i < count ? candidates[i] : 0;
        int r = 0;
        // Every split-th candidate from `part`: the lanes of a candidate read neighbouring words
        // (distinct banks), not runs 16 words apart (one bank).
#pragma unroll RANK_CANDIDATE_UNROLL
        for (int j = part; j < count; j += split) r += candidates[j] > key;
        for (int o = 1; o < split; o <<= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
        // The config has at least top_k experts, so ranks below top_k are real, distinct keys.
        if (part == 0 && i < count && r < d.top_k) {
            ids[r] = (int)(0xffffffffu - (uint32_t)key);
            chosen[r] = key_logit(key);
        }
    }
    if (threadIdx.x == 0) ids[d.top_k] = -1;
    __syncthreads();
}

// The routing weights of the ranked experts (their softmax renormalised over the top_k, from
// rank_experts' `chosen` logits) into weights[0..top_k), and, with `shared_gate`, the shared
// expert's gate sigmoid(logits[experts]) into weights[top_k]; by one warp. Every logit is
// multiplied by `scale` first (the folded router's 1 / rms, see out_proj_route; else 1).
__device__ void routing_weights(const MoeDims& d, const float* chosen, const float* logits, bool shared_gate,
                                float scale, float* weights) {
    const int lane = threadIdx.x & 31;
    const float v = lane < d.top_k ? chosen[lane] * scale : -INFINITY;
    const float top = warp_max(v);
    const float w = lane < d.top_k ? __expf(v - top) : 0.0f;
    const float total = warp_sum(w);
    if (lane < d.top_k) weights[lane] = w / total;
    if (lane == 0 && shared_gate) weights[d.top_k] = sigmoid(logits[d.experts] * scale);
}

// Several tokens at once: a token's rows of the residual stream, router logits, activations and
// routing follow each other at these widths (moe_router_shared, moe_down: blockIdx.z is the token).
__device__ __forceinline__ int act_width(const MoeDims& d) {
    return (d.top_k + 1) * max(d.intermediate, d.shared_intermediate);
}

// One token's routing published early: moe_gate_up's block (0, 0) sets the word once it has
// written the routing, which is soon after its wait, and moe_down's blocks, which may start beside
// moe_gate_up's (the next launch starts once every block of this one has passed its wait, so
// block (0, 0) is resident by then), request their routed rows as soon as they see it instead of
// after their wait. moe_router_shared clears it after its own wait, when the previous layer's
// moe_down has finished with it; moe_down only starts once that clear is done.
__device__ __forceinline__ void clear_routing_ready(unsigned* ready) {
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(ready), "r"(0u) : "memory");
}

// By one thread, after the routing's stores (each fenced by the thread that made it, then a
// barrier over those threads).
__device__ __forceinline__ void publish_routing(unsigned* ready) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(ready), "r"(1u) : "memory");
}

// moe_gate_up's block (0, 0) publishes the ids its warp 0 stored (threads 0..top_k, one each):
// the writers fence, then thread 0 sets the word. Threads past warp 0 return at once.
__device__ __forceinline__ void fence_and_publish_routing(int top_k, unsigned* ready) {
    if (threadIdx.x >= 32) return;
    if (threadIdx.x <= top_k) __threadfence();
    __syncwarp();
    if (threadIdx.x == 0) publish_routing(ready);
}

// By one thread; the block's other threads read the routing after a barrier that follows it.
__device__ __forceinline__ void await_routing(const unsigned* ready) {
    unsigned v;
    for (;;) {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ready) : "memory");
        if (v != 0) return;
        __nanosleep(32);
    }
}

// ---------------------------------------------------------------------------------------------
// The router folded into the mixer's output projection (decode). The router reads
// RMSNorm(h) with h = residual + O m (m the mixer's output, O its output projection), so its
// logits are
//     R (post ⊙ h) / rms(h) = ([R diag(post) O | R diag(post)] · [m ; residual]) / rms(h),
// and the bracket, `fold` ([experts + 1, O.cols + hidden], made once at load by fold_router and
// fold_to_half), needs only what exists before the projection: the same launch computes those
// raw logits beside h (out_proj_route), and moe_gate_up, which stages h anyway, applies 1 / rms(h)
// (the ranking does not change under a positive scale; the routing weights and the shared
// expert's gate take it). That removes the router's own launch, one dependent hop of each
// layer's one-token step. Batched steps compute the same raw logits in moe_router_shared, with
// the same code (fold_rows_*), and moe_route scales them as moe_gate_up does, so that a
// sequence's results in a small batch stay bit for bit its results alone; prefill keeps the
// plain router.

#define FOLD_ROWS 2  // folded router rows per block
#define FOLD_PASS 3  // 16-byte chunks per lane and row in flight

// The folded router on the device: fp16 rows, each to be multiplied by its power-of-two scale.
// fp16's 11-bit significand keeps the folded logits within ~2e-4 of the router's largest (bf16's
// 8 bits: ~2e-3, a fifth of the margin below which the tests call routing a tie); the row scale
// keeps every row inside fp16's range.
struct Fold {
    const uint4* data;
    const float* row_scale;
    int rows;
    int cols;
};

// fold[e] = [(R diag(post) O)[e, :] | (R diag(post))[e, :]] in f32, R = router ([experts + 1,
// hidden], the shared expert's gate last), O the mixer's output projection ([hidden, O.cols]).
// Grid: (ceil(fold columns / 256), ceil((experts + 1) / FOLD_TILE)), 256 threads: each thread a
// column of FOLD_TILE rows, the rows' R diag(post) values shared in blocks of 32 inputs. At load
// time, in f32 sums; fold_to_half then stores it.
#define FOLD_TILE 8
extern "C" __global__ void __launch_bounds__(256) fold_router(Weight router, Weight out_proj, const float* post,
                                                            float* fold) {
    __shared__ float rp[FOLD_TILE][32];
    const int cols = out_proj.cols + router.cols, hidden = router.cols;
    const int col = blockIdx.x * blockDim.x + threadIdx.x, e0 = blockIdx.y * FOLD_TILE;
    float acc[FOLD_TILE] = {};
    for (int i0 = 0; i0 < hidden; i0 += 32) {
        __syncthreads();
        for (int k = threadIdx.x; k < FOLD_TILE * 32; k += blockDim.x) {
            const int e = e0 + k / 32, i = i0 + k % 32;
            rp[k / 32][k % 32] = e < router.rows && i < hidden ? weight_value(router, e, i) * post[i] : 0.0f;
        }
        __syncthreads();
        if (col >= out_proj.cols) continue;
        for (int i = i0; i < min(i0 + 32, hidden); ++i) {
            const float o = weight_value(out_proj, i, col);
#pragma unroll
            for (int t = 0; t < FOLD_TILE; ++t) acc[t] = fmaf(rp[t][i - i0], o, acc[t]);
        }
    }
    if (col >= cols) return;
    for (int t = 0; t < FOLD_TILE; ++t) {
        const int e = e0 + t;
        if (e >= router.rows) break;
        const float v = col < out_proj.cols ? acc[t] : weight_value(router, e, col - out_proj.cols) * post[col - out_proj.cols];
        fold[(size_t)e * cols + col] = v;
    }
}

// Row blockIdx.x of the f32 fold as fp16 times a power of two, row_scale[row], chosen so that
// the row's largest |value| lands in [2^14, 2^15). 256 threads.
extern "C" __global__ void __launch_bounds__(256) fold_to_half(const float* fold, int cols, __half* out,
                                                             float* row_scale) {
    __shared__ float scratch[64];
    const size_t row = blockIdx.x;
    fold += row * cols;
    out += row * cols;
    float largest = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) largest = fmaxf(largest, fabsf(fold[i]));
    largest = block_sum_max(make_float2(0.0f, largest), scratch).y;
    // 2^(e - 15) with largest = m * 2^(e - 1), m in [1, 2): largest / scale in [2^14, 2^15).
    int e = 0;
    frexpf(largest, &e);
    const float scale = largest > 0.0f ? ldexpf(1.0f, e - 15) : 1.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) out[i] = __float2half_rn(fold[i] / scale);
    if (threadIdx.x == 0) row_scale[row] = scale;
}

// One block's folded router rows (FOLD_ROWS of them), their chunks split evenly over the block's
// warps: requested at once, with the residual's part of their inputs (by moe_router_shared before
// its wait, by out_proj_route after it).
struct FoldRows {
    RowRef refs[FOLD_ROWS];
    Pass<FOLD_ROWS, FOLD_PASS> pass;
    float4 z[FOLD_PASS][2];  // the pass's inputs: each chunk's 8 values of z = [m ; residual]
    int begin, end;          // this warp's chunks
    float scale;             // thread i < FOLD_ROWS: row i's scale, read with the rows
};

__device__ __forceinline__ void fold_rows_load(const Fold& fold, int block, FoldRows& f) {
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, chunks = fold.cols / 8;
    const int per_warp = (chunks + warps - 1) / warps;
    f.begin = min(chunks, warp * per_warp);
    f.end = min(chunks, f.begin + per_warp);
#pragma unroll
    for (int i = 0; i < FOLD_ROWS; ++i) {
        const int row = block * FOLD_ROWS + i;
        f.refs[i].data = row < fold.rows ? fold.data + (size_t)row * chunks : nullptr;
        f.refs[i].scales = f.refs[i].biases = nullptr;
    }
    // A weight, read now rather than after the block's reduction (one memory round trip fewer
    // at the end).
    const int own_row = block * FOLD_ROWS + threadIdx.x;
    f.scale = threadIdx.x < FOLD_ROWS && own_row < fold.rows ? fold.row_scale[own_row] : 1.0f;
    // The rows' 16-byte chunks as load_pass reads bf16 rows (it reads no scales for 16 bits).
    load_pass<16, FOLD_ROWS, FOLD_PASS>(f.refs, f.begin, f.end, 0, threadIdx.x & 31, f.pass);
}

// One 16-byte chunk of fp16 weights (8 values) dotted with its 8 inputs (x[0] the first four,
// x[1] the next four), added to acc.
__device__ __forceinline__ void half_chunk_dot(uint4 u, const float4 (&x)[2], float& acc) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const float2 a = __half22float2(as_half2(w[2 * k])), b = __half22float2(as_half2(w[2 * k + 1]));
        acc += x[k].x * a.x + x[k].y * a.y + x[k].z * b.x + x[k].w * b.y;
    }
}

// The inputs of this lane's chunks of the pass at `base` (z = [m ; residual], m_cols + hidden
// values, read straight from global memory: each lane needs only its own chunks' 8 values), of
// the residual's part (`mixed` false: may be read before the wait) or of m's (written by the
// previous launch).
__device__ __forceinline__ void fold_inputs(const float* m, int m_cols, const float* residual, int base, bool mixed,
                                            FoldRows& f) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < FOLD_PASS; ++j) {
        const int c = base + j * 32 + lane, i = 8 * c;
        if (c >= f.end || (i < m_cols) != mixed) continue;
        const float4* src = reinterpret_cast<const float4*>(mixed ? m + i : residual + (i - m_cols));
        f.z[j][0] = src[0];
        f.z[j][1] = src[1];
    }
}

// raw[block * FOLD_ROWS + i] = fold row · z, the first pass's weights and inputs in f (the
// inputs' residual part loaded with the rows, m's after the wait; later passes load both): each
// warp's partial sums, added in warp order, so that every launch computing these rows gets the
// same bits. scratch: warps * FOLD_ROWS floats. Every thread of the block takes part (a barrier).
__device__ void fold_rows_finish(const Fold& fold, const float* m, int m_cols, const float* residual, int block,
                                 FoldRows& f, float* scratch, float* raw) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    RowSums<FOLD_ROWS> acc;
    acc.clear();
    for (int base = f.begin; base < f.end; base += 32 * FOLD_PASS) {
        if (base > f.begin) {
            load_pass<16, FOLD_ROWS, FOLD_PASS>(f.refs, base, f.end, 0, lane, f.pass);
            fold_inputs(m, m_cols, residual, base, false, f);
            fold_inputs(m, m_cols, residual, base, true, f);
        }
#pragma unroll
        for (int j = 0; j < FOLD_PASS; ++j) {
            if (base + j * 32 + lane >= f.end) continue;
#pragma unroll
            for (int i = 0; i < FOLD_ROWS; ++i)
                if (f.refs[i].data != nullptr) half_chunk_dot(f.pass.u[i][j], f.z[j], acc.total[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < FOLD_ROWS; ++i) {
        const float v = warp_sum(acc.total[i]);
        if (lane == 0) scratch[warp * FOLD_ROWS + i] = v;
    }
    __syncthreads();
    if (threadIdx.x < FOLD_ROWS) {
        const int row = block * FOLD_ROWS + threadIdx.x;
        float total = 0.0f;
        for (int w = 0; w < warps; ++w) total += scratch[w * FOLD_ROWS + threadIdx.x];
        if (row < fold.rows) raw[row] = total * f.scale;
    }
}

// The mixer's output projection of one token with the router folded in: blocks below
// fold_blocks (ceil((experts + 1) / FOLD_ROWS)) write the router's raw logits (see above) into
// router_raw, the others h = residual + O m into h (not in place: the folded rows read the
// residual as it was, while other blocks write h). Block 0 also clears routing_ready after its
// wait (moe_router_shared's duty where that launch runs). Grid: (fold_blocks + the projection's
// blocks), 256 threads. Shared memory: 64 + staged_floats(O.cols) floats (the projection's
// staging; the folded rows read their inputs straight from global memory).
extern "C" __global__ void __maxnreg__(72) out_proj_route(Weight o, Fold fold, const float* m, const float* residual,
                                                        float* h, float* router_raw, int fold_blocks,
                                                        unsigned* routing_ready) {
    TRACE_BLOCK();
    extern __shared__ __align__(16) float smem[];
    if ((int)blockIdx.x < fold_blocks) {
        // The folded rows are requested after the wait: these blocks end ~1.2 us before the
        // projection's (block traces), and their 3 MB a layer requested before it delayed the
        // previous kernel's reads and the projection's own (the step 0.5% shorter on an H100).
        wait_for_previous_kernel();
        FoldRows f;
        fold_rows_load(fold, blockIdx.x, f);
        fold_inputs(m, o.cols, residual, f.begin, false, f);
        if (routing_ready != nullptr && blockIdx.x == 0 && threadIdx.x == 0) clear_routing_ready(routing_ready);
        fold_inputs(m, o.cols, residual, f.begin, true, f);
        fold_rows_finish(fold, m, o.cols, residual, blockIdx.x, f, smem, router_raw);
        return;
    }
    matvec_bits<1, 4>(o, m, nullptr, 0.0f, h, residual, smem, blockIdx.x - fold_blocks, gridDim.x - fold_blocks);
}

#define GATE_UP_ROWS_PER_WARP 2
#define MOE_WARPS 8  // warps of a moe_gate_up_tokens block (and of the staging moe_gate_up emulates)
#define DOWN_ROWS_PER_WARP 1
#define DOWN_PASS 4
#ifndef MOE_DOWN_BATCHED_BLOCKS
#define MOE_DOWN_BATCHED_BLOCKS 4  // blocks per SM of moe_down_batched
#endif

typedef Pass<2 * GATE_UP_ROWS_PER_WARP, 2> GateUpPass;

// The gate rows, then the up rows, of intermediates first .. first + GATE_UP_ROWS_PER_WARP - 1
// (of `rows`, from `base` in the stacked weights); intermediates past `rows` get null rows.
__device__ __forceinline__ void gate_up_refs(const Weight& g, const Weight& u, int base, int rows, int first,
                                             RowRef (&refs)[2 * GATE_UP_ROWS_PER_WARP]) {
#pragma unroll
    for (int i = 0; i < GATE_UP_ROWS_PER_WARP; ++i) {
        const int row = first + i < rows ? base + first + i : -1;
        refs[i] = row_ref(g, row);
        refs[GATE_UP_ROWS_PER_WARP + i] = row_ref(u, row);
    }
}

// Requests the rows' first pass (nothing is waited for).
template <int BITS>
__device__ __forceinline__ void gate_up_load(const RowRef (&refs)[2 * GATE_UP_ROWS_PER_WARP], const Weight& g,
                                             GateUpPass& pass) {
    load_pass<BITS, 2 * GATE_UP_ROWS_PER_WARP, 2>(refs, 0, g.cols / values_per_chunk(BITS), g.group_shift,
                                                  threadIdx.x & 31, pass);
}

// out[first + i] = silu(g x) * (u x) for the rows of refs, their first pass in `pass`, x staged
// in xs with products to be multiplied by x_scale (see stage).
template <int BITS>
__device__ void gate_up_finish(const RowRef (&refs)[2 * GATE_UP_ROWS_PER_WARP], const Weight& g, int rows, int first,
                               const float* xs, float x_scale, GateUpPass& pass, float* out) {
    constexpr int R = 2 * GATE_UP_ROWS_PER_WARP;
    const int lane = threadIdx.x & 31;
    RowSums<R> acc;
    acc.clear();
    dot_rows<BITS, R, 2>(refs, staged_x<BITS>(xs, g.cols), g.group_shift, lane, pass, acc);
#pragma unroll
    for (int i = 0; i < GATE_UP_ROWS_PER_WARP; ++i) {
        const float gv = warp_sum(acc.total[i]) * x_scale;
        const float uv = warp_sum(acc.total[GATE_UP_ROWS_PER_WARP + i]) * x_scale;
        if (lane == 0 && first + i < rows) out[first + i] = silu(gv) * uv;
    }
}

// The shared expert's gate/up rows of this block (moe_router_shared): weights requested, then
// x = RMSNorm(residual) staged once the previous kernel has written the residual.
template <int BITS>
__device__ void shared_gate_up_block(const MoeDims& d, const Weight& g, const Weight& u, const float* residual,
                                     const float* norm_scale, float* xs, float* scratch, float* act) {
    const int first = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * GATE_UP_ROWS_PER_WARP;
    RowRef refs[2 * GATE_UP_ROWS_PER_WARP];
    GateUpPass pass;
    gate_up_refs(g, u, 0, d.shared_intermediate, first, refs);
    gate_up_load<BITS>(refs, g, pass);
    wait_for_previous_kernel();
    const StageSource src = {residual, 0, d.hidden, 1, nullptr};
    const float x_scale = stage<BITS>(src, norm_scale, d.eps, xs, scratch);
    // Formed again rather than held through the staging: fewer registers live across it.
    gate_up_refs(g, u, 0, d.shared_intermediate, first, refs);
    gate_up_finish<BITS>(refs, g, d.shared_intermediate, first, xs, x_scale, pass,
                         act + (size_t)d.top_k * max(d.intermediate, d.shared_intermediate));
}

// Everything of the MoE block that does not wait for the routing, in one launch: blocks with
// blockIdx.y == 0 compute the router logits (router: [experts + 1, hidden], the experts' rows
// then the shared-expert gate's) into router_logits, blocks with blockIdx.y == 1 the shared
// expert's act[top_k] = silu(gate · x) * (up · x); x = RMSNorm(residual) for both. With `fold`
// (a batched decode step of a layer whose router is folded into the mixer's output projection,
// see out_proj_route), the router blocks write the raw logits instead, from the mixer's output
// `mixed` and the residual stream `before` it was added, bit for bit as one token's
// out_proj_route does.
// Grid: (max(router row blocks of 8 warps or fold blocks, shared row blocks of 8 warps *
// GATE_UP_ROWS_PER_WARP rows), 2, tokens). Shared memory: 64 + staged_floats(hidden) floats.
extern "C" __global__ void __launch_bounds__(256, 2) moe_router_shared(MoeDims d, Weight router, Fold fold,
                                                                    Weight shared_gate, Weight shared_up,
                                                                    const float* residual, const float* norm_scale,
                                                                    const float* mixed, const float* before,
                                                                    float* router_logits, float* act,
                                                                    unsigned* routing_ready) {
    d = moe_shape(d);
    router = moe_weight(router, d.experts + 1, d.hidden);
    shared_gate = expert_weight(shared_gate, d.shared_intermediate, d.hidden);
    shared_up = expert_weight(shared_up, d.shared_intermediate, d.hidden);
    TRACE_BLOCK();
    extern __shared__ __align__(16) float smem[];
    const size_t token = blockIdx.z;
    residual += token * d.hidden;
    router_logits += token * (d.experts + 1);
    act += token * act_width(d);
    if (blockIdx.y == 0) {
        if (fold.data != nullptr) {
            const int m_cols = fold.cols - d.hidden;
            if ((int)blockIdx.x * FOLD_ROWS >= fold.rows) {
                wait_for_previous_kernel();
            } else {
                FoldRows f;
                fold_rows_load(fold, blockIdx.x, f);
                mixed += token * m_cols;
                before += token * d.hidden;
                fold_inputs(mixed, m_cols, before, f.begin, false, f);
                wait_for_previous_kernel();
                fold_inputs(mixed, m_cols, before, f.begin, true, f);
                fold_rows_finish(fold, mixed, m_cols, before, blockIdx.x, f, smem, router_logits);
            }
        } else {
            matvec_bits<1, 4>(router, residual, norm_scale, d.eps, router_logits, nullptr, smem, blockIdx.x, gridDim.x);
        }
        // After the wait.
        if (routing_ready != nullptr && blockIdx.x == 0 && blockIdx.z == 0 && threadIdx.x == 0)
            clear_routing_ready(routing_ready);
        return;
    }
    float* xs = smem + 64;
    switch (shared_gate.bits) {
        case 4: shared_gate_up_block<4>(d, shared_gate, shared_up, residual, norm_scale, xs, smem, act); break;
        case 8: shared_gate_up_block<8>(d, shared_gate, shared_up, residual, norm_scale, xs, smem, act); break;
        default: shared_gate_up_block<16>(d, shared_gate, shared_up, residual, norm_scale, xs, smem, act); break;
    }
}

// Warps of a moe_gate_up block (gate_up_warps in shapes.rs). For 4-bit experts 16, of
// GATE_UP_ROWS_PER_WARP intermediates each, so that a block holds a whole 32-value chunk of
// moe_down's staged input and writes it (routed_gate_up_block), at a register cap that keeps a
// moe_down block beside one; otherwise 8, writing f32 activations (the 8-bit and bf16 paths
// spill at 16 warps under that cap: 3.7% slower at 8 bits).
#if defined(MOE_BITS) && MOE_BITS == 4
#define GATE_UP_WARPS 16
#define GATE_UP_BOUNDS __maxnreg__(96)
#else
#define GATE_UP_WARPS 8
#define GATE_UP_BOUNDS __launch_bounds__(256, 2)
#endif
#define GATE_UP_BLOCK_ROWS (GATE_UP_WARPS * GATE_UP_ROWS_PER_WARP)

// The routing a moe_gate_up block computes, and its activations, in shared memory (one copy
// for every weight width).
struct Routing {
    unsigned long long keys[2 * MAX_EXPERTS];
    alignas(16) float logits[MAX_EXPERTS + 4];  // the folded router's raw logits (out_proj_route), in 16-byte pieces
    int ids[MAX_TOP_K + 1];
    float chosen[MAX_TOP_K];
    float weights[MAX_TOP_K + 1];
    float act[GATE_UP_BLOCK_ROWS];
};

// With the router folded into the mixer's output projection there is no moe_router_shared
// launch, so moe_gate_up also computes the shared expert's gate/up: each block takes a slice of
// `per` consecutive intermediates (count of them real, from first), whose gate and up rows it
// copies into shared memory before its wait (cp.async: no registers held) and dots while its
// routed rows are in flight. The slice in shared memory: 2 * per rows (gate rows, then up rows)
// of hidden * bits / 8 bytes, then (quantised) their scales, then their biases (2 * per * groups
// each, in whole 16-byte pieces), then 2 * per f32 results (shared_slice_bytes in shapes.rs).
struct SharedSlice {
    int first, count, per;
};

__device__ __forceinline__ SharedSlice shared_slice(const MoeDims& d) {
    const int blocks = gridDim.x * gridDim.y, b = blockIdx.y * gridDim.x + blockIdx.x;
    SharedSlice s;
    s.per = (d.shared_intermediate + blocks - 1) / blocks;
    s.first = b * s.per;
    s.count = max(0, min(s.per, d.shared_intermediate - s.first));
    return s;
}

__device__ __forceinline__ int round16(int bytes) { return (bytes + 15) & ~15; }

template <int BITS>
__device__ __forceinline__ int slice_data_bytes(const MoeDims& d, const SharedSlice& s) {
    return 2 * s.per * (d.hidden * BITS / 8);
}

template <int BITS>
__device__ __forceinline__ int slice_scale_bytes(const MoeDims& d, const SharedSlice& s, int group_shift) {
    return BITS == 16 ? 0 : round16(2 * s.per * (d.hidden >> group_shift) * (int)sizeof(scale_t));
}

// The slice's rows into shared memory (cp.async, committed) and their scales and biases (plain
// loads): before the wait.
template <int BITS>
__device__ void shared_slice_copy(const MoeDims& d, const Weight& g, const Weight& u, const SharedSlice& s, char* slice) {
    const int row_bytes = d.hidden * BITS / 8, pieces = row_bytes / 16;
    const uint32_t dst = shared_address(slice);
    // The row's pointers are picked, not a reference to g or u: a reference picked at run time
    // makes both descriptors addressable, so every thread copies them to local memory first.
    for (int i = threadIdx.x; i < 2 * s.per * pieces; i += blockDim.x) {
        const int r = i / pieces, j = r % s.per;
        const void* data = r < s.per ? g.data : u.data;
        const bool valid = j < s.count;
        const char* src = static_cast<const char*>(data) + (size_t)(valid ? s.first + j : 0) * row_bytes;
        cp_async_16(dst + 16 * i, src + 16 * (i % pieces), valid);
    }
    cp_async_commit();
    if (BITS != 16) {
        const int groups = d.hidden >> g.group_shift;
        scale_t* scales = reinterpret_cast<scale_t*>(slice + slice_data_bytes<BITS>(d, s));
        scale_t* biases = reinterpret_cast<scale_t*>(slice + slice_data_bytes<BITS>(d, s) +
                                                     slice_scale_bytes<BITS>(d, s, g.group_shift));
        for (int i = threadIdx.x; i < 2 * s.per * groups; i += blockDim.x) {
            const int r = i / groups, j = r % s.per;
            const bool gate = r < s.per;
            const scale_t* row_scales = gate ? g.scales : u.scales;
            const scale_t* row_biases = gate ? g.biases : u.biases;
            const size_t at = (size_t)(s.first + j) * groups + i % groups;
            scales[i] = j < s.count ? row_scales[at] : scale_zero();
            biases[i] = j < s.count ? row_biases[at] : scale_zero();
        }
    }
}

// Each warp dots rows of the slice (once its copies are complete and x is staged) into the
// slice's results, times x_scale.
template <int BITS>
__device__ void shared_slice_dot(const MoeDims& d, int group_shift, const SharedSlice& s, char* slice, const float* xs,
                                 float x_scale) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    constexpr int VPC = 128 / BITS;
    const int row_bytes = d.hidden * BITS / 8, chunks = d.hidden / VPC, groups = d.hidden >> group_shift;
    const int data = slice_data_bytes<BITS>(d, s), scale_bytes = slice_scale_bytes<BITS>(d, s, group_shift);
    const scale_t* scales = reinterpret_cast<const scale_t*>(slice + data);
    const scale_t* biases = reinterpret_cast<const scale_t*>(slice + data + scale_bytes);
    float* out = reinterpret_cast<float*>(slice + data + 2 * scale_bytes);
    const StagedX sx = staged_x<BITS>(xs, d.hidden);
    const uint32_t rows = shared_address(slice);
    for (int r = warp; r < 2 * s.per; r += warps) {
        float acc = 0.0f;
        for (int c = lane; c < chunks; c += 32) {
            uint4 xv[4];
            load_x<BITS>(sx, c, xv);
            const float2 stats = BITS == 16 ? make_float2(0.0f, 0.0f) : lds64(sx.csum + 8u * c);
            const int at = r * groups + ((c * VPC) >> group_shift);
            chunk_dot<BITS>(lds128(rows + (uint32_t)(r * row_bytes + 16 * c)), xv, stats,
                            BITS == 16 ? scale_zero() : scales[at], BITS == 16 ? scale_zero() : biases[at], acc);
        }
        acc = warp_sum(acc) * x_scale;
        if (lane == 0) out[r] = acc;
    }
}

// act[first + i] = silu(gate) * up of the slice's results (after a barrier that follows
// shared_slice_dot).
template <int BITS>
__device__ void shared_slice_store(const MoeDims& d, int group_shift, const SharedSlice& s, const char* slice,
                                   float* act) {
    const float* out = reinterpret_cast<const float*>(slice + slice_data_bytes<BITS>(d, s) +
                                                      2 * slice_scale_bytes<BITS>(d, s, group_shift));
    for (int i = threadIdx.x; i < s.count; i += blockDim.x) act[s.first + i] = silu(out[i]) * out[s.per + i];
}

// This block's activations, times its slot's routing weight, into `staged`: moe_down's routed
// input (the slots' activations one after another, top_k * intermediate values) in the staged
// layout of 4-bit weights, bit for bit what moe_down's stage() makes of the f32 activations, so
// that moe_down only copies it (where every one of its blocks staged all of it) and batched
// steps, which stage the activations in moe_down, agree bit for bit. The block's 32
// intermediates are one chunk of that layout (the host takes this path only for 4-bit experts
// whose intermediate size is whole chunks: moe_stages_act). By warp 0.
#if GATE_UP_BLOCK_ROWS == 32
__device__ void stage_block_act(const MoeDims& d, const Routing& r, int slot, float* staged) {
    const int lane = threadIdx.x & 31, block_first = blockIdx.x * GATE_UP_BLOCK_ROWS;
    const bool valid = lane < GATE_UP_BLOCK_ROWS / 8 && block_first + lane * 8 < d.intermediate;
    const int word = (slot * d.intermediate + block_first) / 8 + lane, cols = d.top_k * d.intermediate;
    const float m = r.weights[slot];
    float e[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) e[j] = valid ? r.act[lane * 8 + j] * m : 0.0f;
    stage_word<4>(word, valid, cols, e, staged);
}
#endif

// The routed gate/up rows of this block: x = RMSNorm(residual) staged first (the residual was
// written two launches back), then the routing from the router logits of the previous kernel,
// then the expert's rows. Block (0, 0) also writes the routing out, while its rows arrive. The
// activations go to `act` (f32), or with `staged` non-null (16-warp blocks only) weighted into
// moe_down's staged input (stage_block_act). `folded` (the router folded into the mixer's output
// projection, the previous launch, which also wrote the residual): router_logits are raw, ranked
// as they are; x is staged after the wait, before the ranking, and its 1 / rms scales the routing
// weights; and the block also computes its slice of the shared expert's gate/up (from shared
// memory at `slice`).
template <int BITS>
__device__ void routed_gate_up_block(const MoeDims& d, const Weight& g, const Weight& u, const Weight& sg,
                                     const Weight& su, const float* residual, const float* norm_scale,
                                     const float* router_logits, float* xs, float* scratch, Routing& r, float* act,
                                     int* ids_out, float* weights_out, float* staged, unsigned* routing_ready,
                                     bool folded, char* slice) {
    // Staged as by a block of MOE_WARPS warps: bit for bit the input of moe_gate_up_tokens, so
    // that a batched step's tokens get exactly their one-token activations.
    constexpr int STAGERS = GATE_UP_WARPS == MOE_WARPS ? 0 : MOE_WARPS * 32;
    const StageSource src = {residual, 0, d.hidden, 1, nullptr};
    SharedSlice shared = {0, 0, 0};
    float x_scale = 1.0f;
    const float* logits = router_logits;
    // Folded, with one word of h per staging thread: h is loaded with the logits but staged only
    // once the routed rows are requested, so that the staging is off the way to those requests.
    const bool holds = folded && stage_holds<STAGERS>(src);
    HeldWords<> held;
    if (folded) {
        shared = shared_slice(d);
        shared_slice_copy<BITS>(d, sg, su, shared, slice);
        wait_for_previous_kernel();
        // The raw logits are copied while h is read, so that both come from L2 in one round
        // trip (one token's logits start the buffer: 16-byte aligned). h is read before the
        // routed rows are requested: its L2 read is then not queued behind their HBM reads.
        for (int i = threadIdx.x; 4 * i <= d.experts; i += blockDim.x)
            cp_async_16_part(shared_address(r.logits + 4 * i), router_logits + 4 * i,
                             4 * min(4, d.experts + 1 - 4 * i));
        cp_async_commit();
        logits = r.logits;
        if (holds)
            stage_hold<STAGERS>(src, norm_scale, held);
        else
            x_scale = stage<BITS, STAGERS>(src, norm_scale, d.eps, xs, scratch);
        // The logits and the shared expert's slice, every thread's copies.
        cp_async_wait<0>();
        __syncthreads();
    } else {
        x_scale = stage<BITS, STAGERS>(src, norm_scale, d.eps, xs, scratch);
        wait_for_previous_kernel();
    }
    rank_experts(d, logits, r.keys, r.ids, r.chosen);
    const int slot = blockIdx.y;
    const int first = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * GATE_UP_ROWS_PER_WARP;
    RowRef refs[2 * GATE_UP_ROWS_PER_WARP];
    GateUpPass pass;
    gate_up_refs(g, u, r.ids[slot] * d.intermediate, d.intermediate, first, refs);
    gate_up_load<BITS>(refs, g, pass);
    const bool writes_routing = blockIdx.x == 0 && slot == 0;
    if (folded) {
        // The ids go out to moe_down now (it reads the weights only after its wait).
        if (writes_routing && threadIdx.x < 32 && threadIdx.x <= d.top_k) ids_out[threadIdx.x] = r.ids[threadIdx.x];
        if (holds) x_scale = stage_held<BITS, STAGERS>(src, norm_scale, d.eps, held, xs, scratch);
        // Fenced after the staging's block barrier: a fence holds its thread until the thread's
        // earlier accesses are done, the rows just requested included, so before the barrier it
        // held the whole block for the rows' round trip, and block (0, 0) ended most launches
        // last (docs/BENCHMARKS.md, sixtieth session). The routing goes out about when it did:
        // the fence still ends as the rows arrive.
        if (writes_routing && routing_ready != nullptr) fence_and_publish_routing(d.top_k, routing_ready);
    }
    // The routing weights: for moe_down from block (0, 0), and where this block stages its
    // activations (weighted), for itself.
    if (threadIdx.x < 32 && (writes_routing || staged != nullptr)) {
        routing_weights(d, r.chosen, logits, writes_routing, folded ? x_scale : 1.0f, r.weights);
        __syncwarp();
        if (writes_routing && threadIdx.x <= d.top_k) {
            weights_out[threadIdx.x] = r.weights[threadIdx.x];
            if (!folded) ids_out[threadIdx.x] = r.ids[threadIdx.x];
        }
        if (writes_routing && routing_ready != nullptr && !folded) fence_and_publish_routing(d.top_k, routing_ready);
    }
    // While the routed rows are in flight.
    if (folded) shared_slice_dot<BITS>(d, sg.group_shift, shared, slice, xs, x_scale);
    float* shared_act = act + (size_t)d.top_k * max(d.intermediate, d.shared_intermediate);
#if GATE_UP_BLOCK_ROWS == 32
    if (staged != nullptr) {
        // The block's intermediates (from block_first on) into r.act, then staged from there.
        const int block_first = blockIdx.x * GATE_UP_BLOCK_ROWS;
        gate_up_finish<BITS>(refs, g, d.intermediate - block_first, first - block_first, xs, x_scale, pass, r.act);
        __syncthreads();
        if (threadIdx.x < 32) stage_block_act(d, r, slot, staged);
        if (folded) shared_slice_store<BITS>(d, sg.group_shift, shared, slice, shared_act);
        return;
    }
#endif
    gate_up_finish<BITS>(refs, g, d.intermediate, first, xs, x_scale, pass,
                         act + (size_t)slot * max(d.intermediate, d.shared_intermediate));
    if (folded) {
        __syncthreads();
        shared_slice_store<BITS>(d, sg.group_shift, shared, slice, shared_act);
    }
}

// act[slot] = silu(gate_e · x) * (up_e · x) for each routed slot's expert, x = RMSNorm(residual)
// (or, with `staged`, moe_down's staged input made of them: routed_gate_up_block); with `folded`
// (raw router logits from out_proj_route), also act[top_k], the shared expert's, a slice per block.
// gate/up: routed experts stacked [experts * intermediate, hidden].
// One token. Grid: (row blocks of GATE_UP_BLOCK_ROWS rows, top_k), GATE_UP_WARPS warps. Every
// block routes; block (0, 0) also writes the routing to ids_out/weights_out. Shared memory: 64 +
// staged_floats(hidden) floats, then with `folded` the shared expert's slice.
extern "C" __global__ void GATE_UP_BOUNDS moe_gate_up(MoeDims d, Weight gate, Weight up, Weight shared_gate,
                                                     Weight shared_up, const float* residual,
                                                     const float* norm_scale, const float* router_logits, float* act,
                                                     int* ids_out, float* weights_out, float* staged,
                                                     unsigned* routing_ready, int folded) {
    d = moe_shape(d);
    gate = expert_weight(gate, d.experts * d.intermediate, d.hidden);
    up = expert_weight(up, d.experts * d.intermediate, d.hidden);
    shared_gate = expert_weight(shared_gate, d.shared_intermediate, d.hidden);
    shared_up = expert_weight(shared_up, d.shared_intermediate, d.hidden);
    TRACE_BLOCK();
    extern __shared__ __align__(16) float smem[];
    __shared__ Routing r;
    float* xs = smem + 64;
    char* slice = reinterpret_cast<char*>(xs + staged_floats(d.hidden));
    switch (gate.bits) {
        case 4: routed_gate_up_block<4>(d, gate, up, shared_gate, shared_up, residual, norm_scale, router_logits, xs, smem, r, act, ids_out, weights_out, staged, routing_ready, folded != 0, slice); break;
        case 8: routed_gate_up_block<8>(d, gate, up, shared_gate, shared_up, residual, norm_scale, router_logits, xs, smem, r, act, ids_out, weights_out, staged, routing_ready, folded != 0, slice); break;
        default: routed_gate_up_block<16>(d, gate, up, shared_gate, shared_up, residual, norm_scale, router_logits, xs, smem, r, act, ids_out, weights_out, staged, routing_ready, folded != 0, slice); break;
    }
}

// Batched decode (several tokens, each with its own routing from moe_route): a block takes up to
// MOE_TOKENS_PER_BLOCK tokens in turn, so that one wave of blocks covers them all, where one grid
// row of blocks per token ran in waves, each paying a block's whole chain of latencies. Every
// warp stages one token's input (stage_by_warp, bit for bit the 256-thread stage of the
// one-token kernels above).
#define MOE_TOKENS_PER_BLOCK 8

// The tokens of this block: first = blockIdx.z * per_block, count = at most per_block.
__device__ __forceinline__ int2 block_tokens(int tokens, int per_block) {
    const int first = blockIdx.z * per_block;
    return make_int2(first, min(per_block, tokens - first));
}

template <int BITS>
__device__ void routed_gate_up_tokens(const MoeDims& d, const Weight& g, const Weight& u, const float* residual,
                                      const float* norm_scale, const int* ids, int2 tokens, float* xs,
                                      float* x_scales, int* experts, float* act) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, per = staged_floats_bits(d.hidden, BITS);
    // The residual was written by the mixer's output projection, three launches back.
    for (int i = warp; i < tokens.y; i += MOE_WARPS) {
        const StageSource src = {residual + (size_t)(tokens.x + i) * d.hidden, 0, d.hidden, 1, nullptr};
        const float s = stage_by_warp<BITS, MOE_WARPS>(src, norm_scale, d.eps, xs + (size_t)i * per);
        if (lane == 0) x_scales[i] = s;
    }
    // The routing: moe_route, the previous launch.
    wait_for_previous_kernel();
    const int slot = blockIdx.y;
    if (threadIdx.x < tokens.y) experts[threadIdx.x] = ids[(size_t)(tokens.x + threadIdx.x) * (d.top_k + 1) + slot];
    __syncthreads();
    const int first = (blockIdx.x * MOE_WARPS + warp) * GATE_UP_ROWS_PER_WARP;
    const size_t stride = max(d.intermediate, d.shared_intermediate);
    // One token's rows at a time: a second token's in flight as well would not fit in registers
    // (and the first token's rows of all the blocks' warps already keep HBM busy).
    for (int i = 0; i < tokens.y; ++i) {
        RowRef refs[2 * GATE_UP_ROWS_PER_WARP];
        GateUpPass pass;
        gate_up_refs(g, u, experts[i] * d.intermediate, d.intermediate, first, refs);
        gate_up_load<BITS>(refs, g, pass);
        gate_up_finish<BITS>(refs, g, d.intermediate, first, xs + (size_t)i * per, x_scales[i], pass,
                             act + (size_t)(tokens.x + i) * act_width(d) + slot * stride);
    }
}

// act[t][slot] = silu(gate_e · x_t) * (up_e · x_t), e = ids[t][slot], x_t = RMSNorm(residual[t]),
// for the tokens of this block. Grid: (row blocks of 8 warps * GATE_UP_ROWS_PER_WARP rows, top_k,
// ceil(tokens / per_block)), 256 threads. Shared memory: per_block * staged_floats_bits(hidden,
// bits) floats.
extern "C" __global__ void __launch_bounds__(256, 2) moe_gate_up_tokens(MoeDims d, Weight gate, Weight up,
                                                                     const float* residual, const float* norm_scale,
                                                                     const int* ids, int tokens, int per_block,
                                                                     float* act) {
    d = moe_shape(d);
    gate = expert_weight(gate, d.experts * d.intermediate, d.hidden);
    up = expert_weight(up, d.experts * d.intermediate, d.hidden);
    TRACE_BLOCK();
    extern __shared__ __align__(16) float smem[];
    __shared__ float x_scales[MOE_TOKENS_PER_BLOCK];
    __shared__ int experts[MOE_TOKENS_PER_BLOCK];
    const int2 t = block_tokens(tokens, per_block);
    switch (gate.bits) {
        case 4: routed_gate_up_tokens<4>(d, gate, up, residual, norm_scale, ids, t, smem, x_scales, experts, act); break;
        case 8: routed_gate_up_tokens<8>(d, gate, up, residual, norm_scale, ids, t, smem, x_scales, experts, act); break;
        default: routed_gate_up_tokens<16>(d, gate, up, residual, norm_scale, ids, t, smem, x_scales, experts, act); break;
    }
}

// The routed experts' down projections as one gathered row per output row r: chunk v of the
// row is chunk v % cps of row ids[v / cps] * hidden + r (cps = chunks per expert row), against
// the routed activations staged one after another, each times its routing weight.
template <int BITS>
__device__ __forceinline__ void down_pass(const MoeDims& d, const Weight& w, const int* ids, int r0, int base, int lane,
                                          Pass<DOWN_ROWS_PER_WARP, DOWN_PASS>& p) {
    constexpr int VPC = 128 / BITS;
    const int cps = d.intermediate / VPC, total = cps * d.top_k, groups = d.intermediate >> w.group_shift;
#pragma unroll
    for (int j = 0; j < DOWN_PASS; ++j) {
        const int v = base + j * 32 + lane;
        const int e = div_fast(v, cps), c = v - e * cps;
#pragma unroll
        for (int i = 0; i < DOWN_ROWS_PER_WARP; ++i) {
            const bool valid = v < total && r0 + i < d.hidden;
            const size_t row = valid ? (size_t)ids[e] * d.hidden + r0 + i : 0;
            p.u[i][j] = valid ? load_weights(reinterpret_cast<const uint4*>(w.data) + row * cps + c) : make_uint4(0, 0, 0, 0);
            if (BITS != 16) {
                const size_t g = row * groups + ((c * VPC) >> w.group_shift);
                p.scale[i][j] = valid ? w.scales[g] : scale_zero();
                p.bias[i][j] = valid ? w.biases[g] : scale_zero();
            }
        }
    }
}

// `pass` holds the first pass (requested before the activations were staged).
template <int BITS>
__device__ void down_routed(const MoeDims& d, const Weight& w, const int* ids, const float* xs, int r0,
                            Pass<DOWN_ROWS_PER_WARP, DOWN_PASS>& pass, float (&out)[DOWN_ROWS_PER_WARP]) {
    const int lane = threadIdx.x & 31;
    const StagedX sx = staged_x<BITS>(xs, d.intermediate * d.top_k);
    RowRef rows[DOWN_ROWS_PER_WARP];
#pragma unroll
    for (int i = 0; i < DOWN_ROWS_PER_WARP; ++i) rows[i].data = reinterpret_cast<const uint4*>(w.data);
    RowSums<DOWN_ROWS_PER_WARP> acc;
    acc.clear();
    for (int base = 0; base < sx.chunks; base += 32 * DOWN_PASS) {
        if (base > 0) down_pass<BITS>(d, w, ids, r0, base, lane, pass);
        use_pass<BITS, DOWN_ROWS_PER_WARP, DOWN_PASS>(rows, sx, base, lane, pass, acc);
    }
#pragma unroll
    for (int i = 0; i < DOWN_ROWS_PER_WARP; ++i) out[i] += warp_sum(acc.total[i]);
}

template <int BITS>
__device__ void down_shared_prefetch(const Weight& w, int r0, Pass<DOWN_ROWS_PER_WARP, 1>& pass) {
    RowRef rows[DOWN_ROWS_PER_WARP];
#pragma unroll
    for (int i = 0; i < DOWN_ROWS_PER_WARP; ++i) rows[i] = row_ref(w, r0 + i);
    load_pass<BITS, DOWN_ROWS_PER_WARP, 1>(rows, 0, w.cols / values_per_chunk(BITS), w.group_shift, threadIdx.x & 31,
                                           pass);
}

template <int BITS>
__device__ void down_shared(const Weight& w, const float* xs, int r0, Pass<DOWN_ROWS_PER_WARP, 1>& pass,
                            float (&out)[DOWN_ROWS_PER_WARP]) {
    RowRef rows[DOWN_ROWS_PER_WARP];
#pragma unroll
    for (int i = 0; i < DOWN_ROWS_PER_WARP; ++i) rows[i] = row_ref(w, r0 + i);
    const StagedX sx = staged_x<BITS>(xs, w.cols);
    RowSums<DOWN_ROWS_PER_WARP> acc;
    acc.clear();
    dot_rows<BITS, DOWN_ROWS_PER_WARP, 1>(rows, sx, w.group_shift, threadIdx.x & 31, pass, acc);
#pragma unroll
    for (int i = 0; i < DOWN_ROWS_PER_WARP; ++i) out[i] += warp_sum(acc.total[i]);
}

__device__ __forceinline__ void down_first_pass(const MoeDims& d, const Weight& down, const int* ids, int r0,
                                                Pass<DOWN_ROWS_PER_WARP, DOWN_PASS>& pass) {
    switch (down.bits) {
        case 4: down_pass<4>(d, down, ids, r0, 0, threadIdx.x & 31, pass); break;
        case 8: down_pass<8>(d, down, ids, r0, 0, threadIdx.x & 31, pass); break;
        default: down_pass<16>(d, down, ids, r0, 0, threadIdx.x & 31, pass); break;
    }
}

// residual[r] += sum over routed slots of weight[slot] * (down_e · act[slot])[r]
//              + weight[shared] * (shared_down · act[shared])[r].
// down: routed experts stacked [experts * hidden, intermediate]; shared_down: [hidden, shared_intermediate].
// Grid: (hidden / (8 warps * DOWN_ROWS_PER_WARP), 1, tokens). Shared memory: 64 + staged_floats(top_k *
// intermediate) + staged_floats(shared_intermediate) floats. routed_early: the routing was
// written two launches back (moe_route, for several tokens), so the routed rows are requested
// before the wait; else by the previous kernel (moe_gate_up), and after it, or, with
// routing_ready (one token), once that says it is written (await_routing). routed_staged (one
// token): the routed input already staged and weighted by moe_gate_up, copied instead of staged
// from act.
__device__ __forceinline__ void moe_down_impl(const MoeDims& d, const Weight& down, const Weight& shared_down,
                                              const float* act, const int* ids_in, const float* weights_in,
                                              float* residual, int routed_early, const float* routed_staged,
                                              const unsigned* routing_ready) {
    extern __shared__ __align__(16) float smem[];
    __shared__ int published_ids[MAX_TOP_K];
    const size_t token = blockIdx.z;
    act += token * act_width(d);
    ids_in += token * (d.top_k + 1);
    weights_in += token * (d.top_k + 1);
    residual += token * d.hidden;
    const int r0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * DOWN_ROWS_PER_WARP;
    // The shared expert's rows do not depend on the routing: they go out first.
    Pass<DOWN_ROWS_PER_WARP, 1> shared_pass;
    switch (shared_down.bits) {
        case 4: down_shared_prefetch<4>(shared_down, r0, shared_pass); break;
        case 8: down_shared_prefetch<8>(shared_down, r0, shared_pass); break;
        default: down_shared_prefetch<16>(shared_down, r0, shared_pass); break;
    }
    // The residual rows were last written by the mixer's output projection, two or three
    // launches back: it had ended before the previous launch's blocks passed their waits and
    // let this one start.
    float prior[DOWN_ROWS_PER_WARP];
#pragma unroll
    for (int i = 0; i < DOWN_ROWS_PER_WARP; ++i)
        prior[i] = (threadIdx.x & 31) == 0 && r0 + i < d.hidden ? residual[r0 + i] : 0.0f;
    // The routed rows' first pass goes out as soon as the routing is known (read from L2 by each
    // lane), while the activations are staged.
    Pass<DOWN_ROWS_PER_WARP, DOWN_PASS> routed_pass;
    const int* ids = ids_in;
    // Whether the routing is known before the wait (written two launches back, or published).
    const bool routed_before_wait = routed_early || routing_ready != nullptr;
    if (routing_ready != nullptr) {
        if (threadIdx.x == 0) await_routing(routing_ready);
        __syncthreads();
        // From L2: this SM's L1 may hold an earlier layer's routing at the same address.
        if (threadIdx.x < d.top_k) published_ids[threadIdx.x] = __ldcg(ids_in + threadIdx.x);
        __syncthreads();
        ids = published_ids;
    }
    if (routed_before_wait) down_first_pass(d, down, ids, r0, routed_pass);
    wait_for_previous_kernel();
    if (!routed_before_wait) down_first_pass(d, down, ids, r0, routed_pass);
    const int stride = max(d.intermediate, d.shared_intermediate);
    float* routed_xs = smem + 64;
    float* shared_xs = routed_xs + staged_floats(d.intermediate * d.top_k);
    const StageSource routed = {act, stride, d.intermediate, d.top_k, weights_in};
    const StageSource shared = {act + (size_t)d.top_k * stride, 0, d.shared_intermediate, 1, weights_in + d.top_k};
    // Only a module of 16-warp moe_gate_up blocks (4-bit experts) is ever given the staged input:
    // the others compile without its path.
#if GATE_UP_BLOCK_ROWS == 32
    const bool copies_staged = routed_staged != nullptr;
#else
    const bool copies_staged = false;
#endif
    if (copies_staged) {
        // 16-byte copies in flight while the shared input is staged; complete before the dots.
        const int pieces = staged_floats_bits(d.intermediate * d.top_k, down.bits) / 4;
        const uint32_t dst = shared_address(routed_xs);
        for (int i = threadIdx.x; i < pieces; i += blockDim.x) cp_async_16(dst + 16 * i, routed_staged + 4 * i);
        cp_async_commit();
    } else {
        switch (down.bits) {
            case 4: stage<4>(routed, nullptr, 0.0f, routed_xs, smem); break;
            case 8: stage<8>(routed, nullptr, 0.0f, routed_xs, smem); break;
            default: stage<16>(routed, nullptr, 0.0f, routed_xs, smem); break;
        }
    }
    switch (shared_down.bits) {
        case 4: stage<4>(shared, nullptr, 0.0f, shared_xs, smem); break;
        case 8: stage<8>(shared, nullptr, 0.0f, shared_xs, smem); break;
        default: stage<16>(shared, nullptr, 0.0f, shared_xs, smem); break;
    }
    if (copies_staged) {
        cp_async_wait<0>();
        __syncthreads();
    }
    float out[DOWN_ROWS_PER_WARP] = {};
    switch (down.bits) {
        case 4: down_routed<4>(d, down, ids, routed_xs, r0, routed_pass, out); break;
        case 8: down_routed<8>(d, down, ids, routed_xs, r0, routed_pass, out); break;
        default: down_routed<16>(d, down, ids, routed_xs, r0, routed_pass, out); break;
    }
    switch (shared_down.bits) {
        case 4: down_shared<4>(shared_down, shared_xs, r0, shared_pass, out); break;
        case 8: down_shared<8>(shared_down, shared_xs, r0, shared_pass, out); break;
        default: down_shared<16>(shared_down, shared_xs, r0, shared_pass, out); break;
    }
    if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int i = 0; i < DOWN_ROWS_PER_WARP; ++i)
            if (r0 + i < d.hidden) residual[r0 + i] = prior[i] + out[i];
}

extern "C" __global__ void __launch_bounds__(256, 3) moe_down(MoeDims d, Weight down, Weight shared_down, const float* act,
                                                           const int* ids_in, const float* weights_in,
                                                           float* residual, int routed_early,
                                                           const float* routed_staged,
                                                           const unsigned* routing_ready) {
    d = moe_shape(d);
    down = expert_weight(down, d.experts * d.hidden, d.intermediate);
    shared_down = expert_weight(shared_down, d.hidden, d.shared_intermediate);
    TRACE_BLOCK();
    moe_down_impl(d, down, shared_down, act, ids_in, weights_in, residual, routed_early, routed_staged,
                  routing_ready);
}

// moe_down for batched decode steps, whose grid rows (one per token) run in several waves:
// registers capped (64, no spills; at five blocks it spills) so that four blocks share an SM
// instead of three. The same code as moe_down, so each token's sums are bit for bit what they
// are alone.
extern "C" __global__ void __launch_bounds__(256, MOE_DOWN_BATCHED_BLOCKS) moe_down_batched(
    MoeDims d, Weight down, Weight shared_down, const float* act, const int* ids_in, const float* weights_in,
    float* residual, int routed_early, const float* routed_staged, const unsigned* routing_ready) {
    d = moe_shape(d);
    down = expert_weight(down, d.experts * d.hidden, d.intermediate);
    shared_down = expert_weight(shared_down, d.hidden, d.shared_intermediate);
    TRACE_BLOCK();
    moe_down_impl(d, down, shared_down, act, ids_in, weights_in, residual, routed_early, routed_staged,
                  routing_ready);
}

// Each token's routing from its router logits (ids[t, slot], weights[t, slot]; slot top_k is the
// shared expert, id -1, weight its sigmoid gate), the sum of `splits` partial sums `split_stride`
// floats apart (prefill's gemm_q split k; 1 for the MoE kernels' several tokens); with
// `scale_from`, the raw logits of a folded router, scaled by 1 / rms of that residual stream. One block per
// token, of one warp (prefill's grouped experts) or 256 threads (ahead of moe_gate_up_tokens,
// where it is on a decode batch's critical path).
// 1 / rms(x) over `cols` values, summed exactly as stage() sums them in a block of 256 threads
// (one token's moe_gate_up staging its input): the folded router's scale in batched steps. By
// every thread of a 256-thread block; scratch: 8 floats.
__device__ float rms_scale_as_staged(const float* x, int cols, float eps, float* scratch) {
    const StageSource src = {x, 0, cols, 1, nullptr};
    float ss = 0.0f;
    for (int t = threadIdx.x; t < cols / 8; t += 256) {
        float e[8];
        source_eight(src, nullptr, 8 * t, e, ss);
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = ss;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < 8; ++w) total += scratch[w];
    return rsqrtf(total / cols + eps);
}

extern "C" __global__ void __launch_bounds__(256) moe_route(MoeDims d, const float* router_logits, int splits,
                                                          size_t split_stride, const float* scale_from, int* ids,
                                                          float* weights) {
    d = moe_shape(d);
    __shared__ float logits[MAX_EXPERTS + 1];
    __shared__ unsigned long long keys[2 * MAX_EXPERTS];
    __shared__ int chosen[MAX_TOP_K + 1];
    __shared__ float chosen_logits[MAX_TOP_K];
    __shared__ float scratch[8];
    wait_for_previous_kernel();
    const size_t t = blockIdx.x;
    // A folded router's raw logits (see out_proj_route) are scaled by 1 / rms of the token's
    // residual stream (blocks of 256 threads).
    const float scale =
        scale_from != nullptr ? rms_scale_as_staged(scale_from + t * d.hidden, d.hidden, d.eps, scratch) : 1.0f;
    for (int e = threadIdx.x; e <= d.experts; e += blockDim.x) {
        // The first partial as it is: the one-token kernels rank the logits unchanged.
        float sum = router_logits[t * (d.experts + 1) + e];
        for (int s = 1; s < splits; ++s) sum += router_logits[s * split_stride + t * (d.experts + 1) + e];
        logits[e] = sum;
    }
    __syncthreads();
    rank_experts(d, logits, keys, chosen, chosen_logits);
    if (threadIdx.x < 32) routing_weights(d, chosen_logits, logits, true, scale, weights + t * (d.top_k + 1));
    for (int i = threadIdx.x; i <= d.top_k; i += blockDim.x) ids[t * (d.top_k + 1) + i] = chosen[i];
}

// Prefill: sorts the chunk's routed assignments (a = token * top_k + slot) by expert into
// `order` and cuts each expert's run into tiles of at most `tile` for gemm_q_grouped(_wide):
// tiles[3 i ..] = (expert, start in order, count), tile_count[0] = tiles made. One block of 1024
// threads (at least MAX_EXPERTS): thread e finds expert e's start and first tile by a scan of
// the counts over the block.
extern "C" __global__ void __launch_bounds__(1024) moe_group(MoeDims d, const int* ids, int tokens, int tile,
                                                            int* order, int* tiles, int* tile_count) {
    d = moe_shape(d);
    __shared__ int count[MAX_EXPERTS];
    __shared__ int cursor[MAX_EXPERTS];
    __shared__ unsigned long long warp_totals[32];
    wait_for_previous_kernel();
    const int total = tokens * d.top_k;
    const int e = threadIdx.x, lane = e & 31, warp = e >> 5;
    if (e < d.experts) count[e] = 0;
    __syncthreads();
    for (int a = threadIdx.x; a < total; a += blockDim.x)
        atomicAdd(&count[ids[(a / d.top_k) * (d.top_k + 1) + a % d.top_k]], 1);
    __syncthreads();
    // Inclusive scan of (assignments << 32 | tiles) over the experts: both halves add up
    // separately (a chunk has fewer than 2^32 tiles).
    const int mine = e < d.experts ? count[e] : 0;
    const int my_tiles = (mine + tile - 1) / tile;
    const unsigned long long own = ((unsigned long long)mine << 32) | (unsigned)my_tiles;
    unsigned long long scan = own;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long up = __shfl_up_sync(0xffffffffu, scan, o);
        if (lane >= o) scan += up;
    }
    if (lane == 31) warp_totals[warp] = scan;
    __syncthreads();
    if (warp == 0) {
        unsigned long long t = lane < (int)(blockDim.x / 32) ? warp_totals[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned long long up = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o) t += up;
        }
        warp_totals[lane] = t;
    }
    __syncthreads();
    const unsigned long long before = scan - own + (warp > 0 ? warp_totals[warp - 1] : 0);
    if (e < d.experts) {
        const int start = (int)(before >> 32), first_tile = (int)(before & 0xFFFFFFFFu);
        cursor[e] = start;
        for (int i = 0; i < my_tiles; ++i) {
            tiles[3 * (first_tile + i)] = e;
            tiles[3 * (first_tile + i) + 1] = start + i * tile;
            tiles[3 * (first_tile + i) + 2] = min(tile, mine - i * tile);
        }
        if (e == d.experts - 1) tile_count[0] = first_tile + my_tiles;
    }
    __syncthreads();
    for (int a = threadIdx.x; a < total; a += blockDim.x) {
        const int ex = ids[(a / d.top_k) * (d.top_k + 1) + a % d.top_k];
        order[atomicAdd(&cursor[ex], 1)] = a;
    }
}

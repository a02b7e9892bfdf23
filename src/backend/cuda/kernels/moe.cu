// The sparse MoE block, decode: routing (softmax over the router logits, top-k, renormalised)
// stays on the GPU; the selected experts and the shared expert run as slots of one launch each
// for gate/up (with SwiGLU) and for down (weighted sum added to the residual stream).
//
// Slots 0..top_k-1 are routed experts, slot top_k is the shared expert, whose weight is
// sigmoid(shared_expert_gate · x). The router launch (a plain `matvec`) writes the expert logits
// followed by the shared-expert gate logit.

#define MAX_TOP_K 32

struct MoeDims {
    int experts, top_k, intermediate, shared_intermediate, hidden;
    float eps;
};

// Picks the top_k experts from `logits` (in shared memory; consumed: chosen entries become
// -inf; ties to the lower id) and their renormalised softmax weights, plus the shared expert's
// gate; run by one warp, results in shared memory.
__device__ void route(const MoeDims& d, float* logits, int* ids, float* weights) {
    const int lane = threadIdx.x & 31;
    const float shared_logit = logits[d.experts];
    float chosen_max = -INFINITY;
    float total = 0.0f;
    for (int s = 0; s < d.top_k; ++s) {
        float best = -INFINITY;
        int best_id = 0x7fffffff;
        for (int e = lane; e < d.experts; e += 32) {
            const float v = logits[e];
            if (v > best) { best = v; best_id = e; }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, best_id, o);
            if (ov > best || (ov == best && oi < best_id)) { best = ov; best_id = oi; }
        }
        if (s == 0) chosen_max = best;
        const float w = __expf(best - chosen_max);
        total += w;
        if (lane == 0) { ids[s] = best_id; weights[s] = w; logits[best_id] = -INFINITY; }
        __syncwarp();
    }
    if (lane == 0) {
        for (int s = 0; s < d.top_k; ++s) weights[s] /= total;
        ids[d.top_k] = -1;
        weights[d.top_k] = sigmoid(shared_logit);
    }
}

#define GATE_UP_ROWS_PER_WARP 2
#define DOWN_ROWS_PER_WARP 1
#define DOWN_SLOTS_PER_PASS 8
#define MAX_EXPERTS 1024

template <int BITS>
__device__ void gate_up_rows(const Weight& g, const Weight& u, int base, int rows, int first, const float* xs,
                             float* out) {
    constexpr int R = 2 * GATE_UP_ROWS_PER_WARP;
    const int lane = threadIdx.x & 31;
    RowRef refs[R];
    float acc[R];
#pragma unroll
    for (int i = 0; i < GATE_UP_ROWS_PER_WARP; ++i) {
        const int row = first + i < rows ? base + first + i : -1;
        refs[i] = row_ref(g, row, xs);
        refs[GATE_UP_ROWS_PER_WARP + i] = row_ref(u, row, xs);
        acc[i] = acc[GATE_UP_ROWS_PER_WARP + i] = 0.0f;
    }
    Pass<R, 2> pass;
    load_pass<BITS, R, 2>(refs, 0, g.group, lane, pass);
    dot_rows<BITS, R, 2, true>(refs, refs[0].chunks, g.group, lane, pass, acc);
#pragma unroll
    for (int i = 0; i < GATE_UP_ROWS_PER_WARP; ++i) {
        const float gv = warp_sum(acc[i]), uv = warp_sum(acc[GATE_UP_ROWS_PER_WARP + i]);
        if (lane == 0 && first + i < rows) out[first + i] = silu(gv) * uv;
    }
}

// act[slot] = silu(gate_e · x) * (up_e · x) for each slot's expert, x = RMSNorm(residual).
// gate/up: routed experts stacked [experts * intermediate, hidden]; shared_*: [shared_intermediate, hidden].
// Grid: (row blocks of 8 warps * GATE_UP_ROWS_PER_WARP rows, top_k + 1). Every block routes
// (from the router logits, while the input is being staged); block (0, 0) also writes the
// routing to ids_out/weights_out. Shared memory: 32 + staged_floats(hidden) floats.
extern "C" __global__ void __launch_bounds__(256, 2) moe_gate_up(MoeDims d, Weight gate, Weight up, Weight shared_gate,
                                                              Weight shared_up, const float* residual,
                                                              const float* norm_scale, const float* router_logits,
                                                              float* act, int* ids_out, float* weights_out) {
    wait_for_previous_kernel();
    extern __shared__ __align__(16) float smem[];
    __shared__ float logits[MAX_EXPERTS + 1];
    __shared__ int ids[MAX_TOP_K + 1];
    __shared__ float weights[MAX_TOP_K + 1];
    const int slot = blockIdx.y;
    const bool shared = slot == d.top_k;
    for (int e = threadIdx.x; e <= d.experts; e += blockDim.x) logits[e] = router_logits[e];
    const float ss = block_sum(sum_of_squares(residual, d.hidden), smem);
    const Weight& g = shared ? shared_gate : gate;
    const Weight& u = shared ? shared_up : up;
    float* xs = smem + 32;
    stage_values(g.bits, d.hidden, residual, norm_scale, rsqrtf(ss / d.hidden + d.eps), xs);
    __syncthreads();
    // The last warp routes while the others sum the chunks.
    if (threadIdx.x >= blockDim.x - 32) route(d, logits, ids, weights);
    else stage_chunk_sums(g.bits, d.hidden, xs, blockDim.x - 32);
    __syncthreads();
    if (blockIdx.x == 0 && slot == 0 && threadIdx.x <= d.top_k) {
        ids_out[threadIdx.x] = ids[threadIdx.x];
        weights_out[threadIdx.x] = weights[threadIdx.x];
    }
    const int rows = shared ? d.shared_intermediate : d.intermediate;
    const int base = shared ? 0 : ids[slot] * d.intermediate;
    const int first = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * GATE_UP_ROWS_PER_WARP;
    float* out = act + (size_t)slot * max(d.intermediate, d.shared_intermediate);
    switch (g.bits) {
        case 4: gate_up_rows<4>(g, u, base, rows, first, xs, out); break;
        case 8: gate_up_rows<8>(g, u, base, rows, first, xs, out); break;
        default: gate_up_rows<16>(g, u, base, rows, first, xs, out); break;
    }
}

// The rows of one routed pass: slots pass..pass+DOWN_SLOTS_PER_PASS-1, output rows from r0.
__device__ __forceinline__ void down_refs(const MoeDims& d, const Weight& down, const int* ids, const float* staged,
                                          int per_slot, int pass, int r0,
                                          RowRef (&refs)[DOWN_SLOTS_PER_PASS * DOWN_ROWS_PER_WARP]) {
#pragma unroll
    for (int i = 0; i < DOWN_SLOTS_PER_PASS; ++i)
#pragma unroll
        for (int k = 0; k < DOWN_ROWS_PER_WARP; ++k) {
            const int s = pass + i, r = r0 + k;
            const int row = s < d.top_k && r < d.hidden ? ids[s] * d.hidden + r : -1;
            refs[i * DOWN_ROWS_PER_WARP + k] = row_ref(down, row, staged + (size_t)min(s, d.top_k) * per_slot);
        }
}

// sum[k] += sum over the routed slots of weight[slot] * (down_e · act[slot])[r0 + k]. The first
// pass is already loaded in `pass`; the activations must be staged by now.
template <int BITS>
__device__ void down_routed(const MoeDims& d, const Weight& down, const int* ids, const float* weights,
                            const float* staged, int per_slot, int r0,
                            RowRef (&refs)[DOWN_SLOTS_PER_PASS * DOWN_ROWS_PER_WARP],
                            Pass<DOWN_SLOTS_PER_PASS * DOWN_ROWS_PER_WARP, 1>& pass, float (&sum)[DOWN_ROWS_PER_WARP]) {
    const int lane = threadIdx.x & 31;
    constexpr int R = DOWN_SLOTS_PER_PASS * DOWN_ROWS_PER_WARP;
    for (int first = 0; first < d.top_k; first += DOWN_SLOTS_PER_PASS) {
        if (first > 0) {
            down_refs(d, down, ids, staged, per_slot, first, r0, refs);
            load_pass<BITS, R, 1>(refs, 0, down.group, lane, pass);
        }
        float acc[R];
#pragma unroll
        for (int i = 0; i < R; ++i) acc[i] = 0.0f;
        dot_rows<BITS, R, 1, false>(refs, refs[0].chunks, down.group, lane, pass, acc);
#pragma unroll
        for (int i = 0; i < DOWN_SLOTS_PER_PASS; ++i)
#pragma unroll
            for (int k = 0; k < DOWN_ROWS_PER_WARP; ++k) {
                const float v = warp_sum(acc[i * DOWN_ROWS_PER_WARP + k]);
                if (first + i < d.top_k) sum[k] += weights[first + i] * v;
            }
    }
}

// sum[k] += weight * (shared_down · act[shared])[r0 + k].
template <int BITS>
__device__ void down_shared(const Weight& w, float weight, const float* xs, int r0, float (&sum)[DOWN_ROWS_PER_WARP]) {
    const int lane = threadIdx.x & 31;
    RowRef refs[DOWN_ROWS_PER_WARP];
    float acc[DOWN_ROWS_PER_WARP];
#pragma unroll
    for (int k = 0; k < DOWN_ROWS_PER_WARP; ++k) {
        refs[k] = row_ref(w, r0 + k, xs);
        acc[k] = 0.0f;
    }
    Pass<DOWN_ROWS_PER_WARP, 1> pass;
    load_pass<BITS, DOWN_ROWS_PER_WARP, 1>(refs, 0, w.group, lane, pass);
    dot_rows<BITS, DOWN_ROWS_PER_WARP, 1, true>(refs, refs[0].chunks, w.group, lane, pass, acc);
#pragma unroll
    for (int k = 0; k < DOWN_ROWS_PER_WARP; ++k) sum[k] += weight * warp_sum(acc[k]);
}

template <int BITS>
__device__ void down_first_pass(const MoeDims& d, const Weight& down, const int* ids, const float* staged,
                                int per_slot, int r0, RowRef (&refs)[DOWN_SLOTS_PER_PASS * DOWN_ROWS_PER_WARP],
                                Pass<DOWN_SLOTS_PER_PASS * DOWN_ROWS_PER_WARP, 1>& pass) {
    down_refs(d, down, ids, staged, per_slot, 0, r0, refs);
    load_pass<BITS, DOWN_SLOTS_PER_PASS * DOWN_ROWS_PER_WARP, 1>(refs, 0, down.group, threadIdx.x & 31, pass);
}

// residual[r] += sum over slots of weight[slot] * (down_e · act[slot])[r].
// down: routed experts stacked [experts * hidden, intermediate]; shared_down: [hidden, shared_intermediate].
// Grid: hidden / (8 warps * DOWN_ROWS_PER_WARP) blocks. Shared memory: 32 + (top_k + 1) *
// staged_floats(max(intermediate, shared_intermediate)) floats.
extern "C" __global__ void __launch_bounds__(256, 2) moe_down(MoeDims d, Weight down, Weight shared_down, const float* act,
                                                           const int* ids_in, const float* weights_in,
                                                           float* residual) {
    wait_for_previous_kernel();
    extern __shared__ __align__(16) float smem[];
    __shared__ int ids[MAX_TOP_K + 1];
    __shared__ float weights[MAX_TOP_K + 1];
    if (threadIdx.x <= d.top_k) {
        ids[threadIdx.x] = ids_in[threadIdx.x];
        weights[threadIdx.x] = weights_in[threadIdx.x];
    }
    __syncthreads();
    const int stride = max(d.intermediate, d.shared_intermediate);
    const int per_slot = staged_floats(stride);
    float* staged = smem + 32;
    const int r0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * DOWN_ROWS_PER_WARP;
    // The first experts' weights are in flight while the activations are staged.
    RowRef refs[DOWN_SLOTS_PER_PASS * DOWN_ROWS_PER_WARP];
    Pass<DOWN_SLOTS_PER_PASS * DOWN_ROWS_PER_WARP, 1> pass;
    switch (down.bits) {
        case 4: down_first_pass<4>(d, down, ids, staged, per_slot, r0, refs, pass); break;
        case 8: down_first_pass<8>(d, down, ids, staged, per_slot, r0, refs, pass); break;
        default: down_first_pass<16>(d, down, ids, staged, per_slot, r0, refs, pass); break;
    }
    for (int s = 0; s <= d.top_k; ++s) {
        const Weight& w = s == d.top_k ? shared_down : down;
        stage_values(w.bits, w.cols, act + (size_t)s * stride, nullptr, 1.0f, staged + (size_t)s * per_slot);
    }
    __syncthreads();
    for (int s = 0; s <= d.top_k; ++s) {
        const Weight& w = s == d.top_k ? shared_down : down;
        stage_chunk_sums(w.bits, w.cols, staged + (size_t)s * per_slot, blockDim.x);
    }
    __syncthreads();
    float sum[DOWN_ROWS_PER_WARP] = {};
    switch (down.bits) {
        case 4: down_routed<4>(d, down, ids, weights, staged, per_slot, r0, refs, pass, sum); break;
        case 8: down_routed<8>(d, down, ids, weights, staged, per_slot, r0, refs, pass, sum); break;
        default: down_routed<16>(d, down, ids, weights, staged, per_slot, r0, refs, pass, sum); break;
    }
    const float* shared_xs = staged + (size_t)d.top_k * per_slot;
    const float shared_weight = weights[d.top_k];
    switch (shared_down.bits) {
        case 4: down_shared<4>(shared_down, shared_weight, shared_xs, r0, sum); break;
        case 8: down_shared<8>(shared_down, shared_weight, shared_xs, r0, sum); break;
        default: down_shared<16>(shared_down, shared_weight, shared_xs, r0, sum); break;
    }
    if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int k = 0; k < DOWN_ROWS_PER_WARP; ++k)
            if (r0 + k < d.hidden) residual[r0 + k] += sum[k];
}

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

// Picks the top_k experts from `logits` (ties to the lower id) and their renormalised softmax
// weights, plus the shared expert's gate; run by one warp, results in shared memory.
__device__ void route(const MoeDims& d, const float* logits, int* ids, float* weights) {
    const int lane = threadIdx.x & 31;
    float chosen_max = -INFINITY;
    float total = 0.0f;
    for (int s = 0; s < d.top_k; ++s) {
        float best = -INFINITY;
        int best_id = 0x7fffffff;
        for (int e = lane; e < d.experts; e += 32) {
            bool taken = false;
            for (int t = 0; t < s; ++t) taken |= ids[t] == e;
            const float v = logits[e];
            if (!taken && (v > best || (v == best && e < best_id))) { best = v; best_id = e; }
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
        if (lane == 0) { ids[s] = best_id; weights[s] = w; }
        __syncwarp();
    }
    if (lane == 0) {
        for (int s = 0; s < d.top_k; ++s) weights[s] /= total;
        ids[d.top_k] = -1;
        weights[d.top_k] = sigmoid(logits[d.experts]);
    }
}

// act[slot] = silu(gate_e · x) * (up_e · x) for each slot's expert, x = RMSNorm(residual).
// gate/up: routed experts stacked [experts * intermediate, hidden]; shared_*: [shared_intermediate, hidden].
// Grid: (row blocks, top_k + 1). Block (0, 0) also writes the routing to ids_out/weights_out.
extern "C" __global__ void __launch_bounds__(256) moe_gate_up(MoeDims d, Weight gate, Weight up, Weight shared_gate, Weight shared_up,
                                       const float* residual, const float* norm_scale, const float* router_logits,
                                       float* act, int* ids_out, float* weights_out) {
    extern __shared__ float smem[];
    __shared__ int ids[MAX_TOP_K + 1];
    __shared__ float weights[MAX_TOP_K + 1];
    const int slot = blockIdx.y;
    const bool shared = slot == d.top_k;
    if (threadIdx.x < 32) route(d, router_logits, ids, weights);
    __syncthreads();
    if (blockIdx.x == 0 && slot == 0 && threadIdx.x <= d.top_k) {
        ids_out[threadIdx.x] = ids[threadIdx.x];
        weights_out[threadIdx.x] = weights[threadIdx.x];
    }
    const Weight& g = shared ? shared_gate : gate;
    const Weight& u = shared ? shared_up : up;
    const int rows = shared ? d.shared_intermediate : d.intermediate;
    const int base = shared ? 0 : ids[slot] * d.intermediate;

    float* scratch = smem;
    float* xs = smem + 32;
    float* gsum = xs + d.hidden;
    stage_input(g, residual, norm_scale, d.eps, xs, gsum, scratch);
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int stride = max(d.intermediate, d.shared_intermediate);
    for (int r = blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += gridDim.x * warps) {
        const float gv = row_dot(g, base + r, xs, gsum, lane);
        const float uv = row_dot(u, base + r, xs, gsum, lane);
        if (lane == 0) act[(size_t)slot * stride + r] = silu(gv) * uv;
    }
}

// residual[r] += sum over slots of weight[slot] * (down_e · act[slot])[r].
// down: routed experts stacked [experts * hidden, intermediate]; shared_down: [hidden, shared_intermediate].
extern "C" __global__ void __launch_bounds__(256) moe_down(MoeDims d, Weight down, Weight shared_down, const float* act, const int* ids,
                                    const float* weights, float* residual) {
    extern __shared__ float smem[];
    float* scratch = smem;
    float* staged = smem + 32;
    const int slots = d.top_k + 1;
    const int stride = max(d.intermediate, d.shared_intermediate);
    // Each slot's activations and group sums, one after the other.
    const int per_slot = stride + stride / 32 + 1;
    for (int s = 0; s < slots; ++s) {
        const Weight& w = s == d.top_k ? shared_down : down;
        float* xs = staged + (size_t)s * per_slot;
        stage_input(w, act + (size_t)s * stride, nullptr, 0.0f, xs, xs + w.cols, scratch);
    }
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int r = blockIdx.x * warps + (threadIdx.x >> 5); r < d.hidden; r += gridDim.x * warps) {
        float sum = 0.0f;
        for (int s = 0; s < slots; ++s) {
            const bool shared = s == d.top_k;
            const Weight& w = shared ? shared_down : down;
            const int row = shared ? r : ids[s] * d.hidden + r;
            const float* xs = staged + (size_t)s * per_slot;
            sum += weights[s] * row_dot(w, row, xs, xs + w.cols, lane);
        }
        if (lane == 0) residual[r] += sum;
    }
}

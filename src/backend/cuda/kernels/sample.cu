// Picking the next token on the GPU so only its id crosses to the host: an argmax over the
// logits in two passes (per-block partial maxima, then one block), which also advances the
// sequence's position counter, the last act of a decode step.

// Ties go to the lower id, as torch.argmax does.
__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
}

// Row blockIdx.y of the logits (a batched step's sequence), partials gridDim.x per row.
extern "C" __global__ void __launch_bounds__(256) argmax_partial(const float* logits, int n, float* part_val, int* part_idx) {
    TRACE_BLOCK();
    wait_for_previous_kernel();
    logits += (size_t)blockIdx.y * n;
    part_val += (size_t)blockIdx.y * gridDim.x;
    part_idx += (size_t)blockIdx.y * gridDim.x;
    __shared__ float vals[32];
    __shared__ int idxs[32];
    float v = -INFINITY;
    int idx = 0x7fffffff;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) better(v, idx, logits[i], i);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) better(v, idx, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, idx, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { vals[warp] = v; idxs[warp] = idx; }
    __syncthreads();
    if (warp == 0) {
        const int warps = blockDim.x >> 5;
        v = lane < warps ? vals[lane] : -INFINITY;
        idx = lane < warps ? idxs[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) better(v, idx, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, idx, o));
        if (lane == 0) { part_val[blockIdx.x] = v; part_idx[blockIdx.x] = idx; }
    }
}

// One warp per row (blockIdx.y): the overall argmax becomes the next input token, also written
// to chosen[row] when `chosen` is non-null; the position advances. Batched, the row's sequence's
// token and position come from the tables (see seq_buffer).
extern "C" __global__ void __launch_bounds__(32) argmax_final(const float* part_val, const int* part_idx, int parts, int* token,
                                        int* position, const unsigned long long* token_of,
                                        const unsigned long long* position_of, int* chosen) {
    TRACE_BLOCK();
    wait_for_previous_kernel();
    const int row = blockIdx.y;
    part_val += (size_t)row * parts;
    part_idx += (size_t)row * parts;
    token = seq_buffer(token, token_of, row);
    position = seq_buffer(position, position_of, row);
    const int lane = threadIdx.x;
    float v = -INFINITY;
    int idx = 0x7fffffff;
    for (int i = lane; i < parts; i += 32) better(v, idx, part_val[i], part_idx[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) better(v, idx, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, idx, o));
    // No finite logit at all: token 0 rather than an id outside the embedding.
    if (lane == 0) {
        const int id = idx < 0x7fffffff ? idx : 0;
        token[0] = id;
        position[0] += 1;
        if (chosen != nullptr) chosen[row] = id;
    }
}

// Advances the position counter by `by`: after a step whose token the host picks (sampling on
// the host), or after a prefill chunk. Batched: the position of sequence blockIdx.y of the table.
extern "C" __global__ void advance_position(int* position, int by, const unsigned long long* position_of) {
    TRACE_BLOCK();
    wait_for_previous_kernel();
    position = seq_buffer(position, position_of, blockIdx.y);
    position[0] += by;
}

// Sampling on the device: temperature, top-k, top-p and min-p filters, then one draw, by a single
// block, so that only the chosen id crosses to the host. The thresholds come from radix selects
// over the logits' order-preserving bit patterns (four 8-bit passes each), the draw is the
// Gumbel-max trick (the argmax of logit / T + Gumbel noise is a draw from the softmax), and the
// noise is a hash of (seed, token id), so the same seed gives the same token. Probability mass is
// summed in fixed point so the top-p cut does not depend on the order of atomic additions.

#define SAMPLE_THREADS 1024

struct SamplingDesc {
    float temperature;  // > 0
    int top_k;          // 0: off
    float top_p;        // 1: off
    float min_p;        // 0: off
    int allowed;        // ids from here up (vocabulary padding) are never drawn
    unsigned long long seed;
};

// Larger floats give larger keys (NaN aside).
__device__ __forceinline__ uint32_t order_key(float f) {
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// Gumbel noise for token i: -log(-log(u)), u uniform in (0, 1).
__device__ __forceinline__ float gumbel(unsigned long long seed, int i) {
    const unsigned long long h = splitmix64(seed ^ splitmix64((unsigned long long)i));
    const float u = ((float)(h >> 40) + 0.5f) * (1.0f / 16777216.0f);
    return -logf(-logf(u));
}

// Weight 2^32 * exp((l - max) / T) of a logit, as fixed point (at most 2^32).
__device__ __forceinline__ unsigned long long fixed_weight(float l, float max_logit, float inv_t) {
    return (unsigned long long)(__expf((l - max_logit) * inv_t) * 4294967296.0f);
}

// The largest key K such that the keys >= K that pass `kept` hold at least `target` of the
// measure `amount` (count or fixed-point mass), found 8 bits at a time from the top.
template <typename Amount, typename Kept>
__device__ uint32_t radix_threshold(const float* logits, int n, unsigned long long target, Amount amount, Kept kept,
                                    unsigned long long* hist, uint32_t* shared_prefix,
                                    unsigned long long* shared_above) {
    uint32_t prefix = 0, mask = 0;
    unsigned long long above = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float l = logits[i];
            const uint32_t k = order_key(l);
            if ((k & mask) == prefix && kept(l, k)) atomicAdd(&hist[(k >> shift) & 255u], amount(l));
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int chosen = -1;
            for (int b = 255; b >= 0; --b) {
                if (hist[b] == 0) continue;
                chosen = b;
                if (above + hist[b] >= target) break;
                above += hist[b];
            }
            // Rounding can leave the target just out of reach: the lowest non-empty bin then.
            *shared_prefix = prefix | ((uint32_t)(chosen < 0 ? 0 : chosen) << shift);
            *shared_above = above;
        }
        __syncthreads();
        prefix = *shared_prefix;
        above = *shared_above;
        mask |= 255u << shift;
        __syncthreads();
    }
    return prefix;
}

// Draws the next token from the logits with the slot's sampling settings; it becomes the next
// input token (also written to chosen[row] when `chosen` is non-null) and the position advances.
// Launch: one block of SAMPLE_THREADS threads per row of logits (blockIdx.y); batched, the row's
// sequence's settings, token and position come from the tables (see seq_buffer).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_token(const float* logits, int n,
                                                                          const SamplingDesc* desc, int* token,
                                                                          int* position,
                                                                          const unsigned long long* desc_of,
                                                                          const unsigned long long* token_of,
                                                                          const unsigned long long* position_of,
                                                                          int* chosen) {
    TRACE_BLOCK();
    wait_for_previous_kernel();
    const int row = blockIdx.y;
    logits += (size_t)row * n;
    desc = seq_buffer(desc, desc_of, row);
    token = seq_buffer(token, token_of, row);
    position = seq_buffer(position, position_of, row);
    __shared__ float scratch[32];
    __shared__ unsigned long long hist[256];
    __shared__ uint32_t shared_prefix;
    __shared__ unsigned long long shared_above;
    __shared__ unsigned long long shared_total;
    const SamplingDesc d = *desc;
    const float inv_t = 1.0f / d.temperature;
    n = min(n, d.allowed);

    float m = -INFINITY;
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, logits[i]);
    m = block_max(m, scratch);
    const unsigned long long min_weight =
        d.min_p > 0.0f ? (unsigned long long)(d.min_p * 4294967296.0f) : 0ull;
    auto finite = [](float l, uint32_t) { return isfinite(l); };
    auto one = [](float) { return 1ull; };
    uint32_t threshold = 0;
    if (d.top_k > 0 && d.top_k < n)
        threshold = radix_threshold(logits, n, (unsigned long long)d.top_k, one, finite, hist, &shared_prefix,
                                    &shared_above);
    // The filters apply in the host sampler's order: top-k, then top-p over what top-k kept,
    // then min-p (relative to the most likely token, so unaffected by renormalisation).
    const uint32_t top_k_threshold = threshold;
    auto after_top_k = [&](float l, uint32_t k) { return isfinite(l) && k >= top_k_threshold; };
    if (d.top_p < 1.0f) {
        if (threadIdx.x == 0) shared_total = 0;
        __syncthreads();
        unsigned long long total = 0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float l = logits[i];
            if (after_top_k(l, order_key(l))) total += fixed_weight(l, m, inv_t);
        }
        atomicAdd(&shared_total, total);
        __syncthreads();
        const unsigned long long target = (unsigned long long)((double)shared_total * (double)d.top_p);
        auto mass = [&](float l) { return fixed_weight(l, m, inv_t); };
        threshold = radix_threshold(logits, n, target > 0 ? target : 1ull, mass, after_top_k, hist, &shared_prefix,
                                    &shared_above);
        threshold = max(threshold, top_k_threshold);
    }
    auto kept = [&](float l, uint32_t k) {
        return isfinite(l) && k >= threshold && fixed_weight(l, m, inv_t) >= min_weight;
    };

    float best = -INFINITY;
    int best_id = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float l = logits[i];
        if (!kept(l, order_key(l))) continue;
        better(best, best_id, (l - m) * inv_t + gumbel(d.seed, i), i);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        better(best, best_id, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, best_id, o));
    __shared__ float vals[32];
    __shared__ int idxs[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { vals[warp] = best; idxs[warp] = best_id; }
    __syncthreads();
    if (warp == 0) {
        const int warps = blockDim.x >> 5;
        best = lane < warps ? vals[lane] : -INFINITY;
        best_id = lane < warps ? idxs[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            better(best, best_id, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, best_id, o));
        // No finite logit at all: token 0 rather than an id outside the embedding.
        if (lane == 0) {
            const int id = best_id < n ? best_id : 0;
            token[0] = id;
            position[0] += 1;
            if (chosen != nullptr) chosen[row] = id;
        }
    }
}

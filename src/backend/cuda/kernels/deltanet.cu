// One fused Gated DeltaNet decode step: causal conv (ring-buffered history), SiLU, L2 norms,
// gates, the fp32 recurrent delta-rule update and the gated RMSNorm.
//
// The update is independent per column of a head's [key_dim, value_dim] state, so each head is
// split over a cluster of `splits` blocks that own value_dim / splits columns each: 4x the blocks
// (and bytes in flight) of one block per head. Only the gated RMSNorm spans the head's columns;
// the blocks of a cluster exchange their partial sums of squares through distributed shared
// memory.
//
// The conv history is a ring of `kernel` slots indexed by position: this step writes slot
// pos % kernel and reads the other kernel - 1 slots, so blocks sharing a channel never race.

#define MAX_ROWS_PER_THREAD 16
#define MAX_CONV_KERNEL 4

struct DeltaNetDims {
    int key_heads, value_heads, key_dim, value_dim, kernel, splits;
    float eps;
};

__device__ __forceinline__ void cluster_barrier() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The float at `local` (a shared-memory variable of this block) in block `rank` of the cluster.
__device__ __forceinline__ float cluster_load(const float* local, uint32_t rank) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(shared_address(local)), "r"(rank));
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

// Floats of one token's projection: [conv_dim (q|k|v) | z (value_heads*value_dim) |
// b (value_heads) | a (value_heads)].
__device__ __forceinline__ int deltanet_proj_width(const DeltaNetDims& d, int conv_dim) {
    return conv_dim + d.value_heads * d.value_dim + 2 * d.value_heads;
}

// `tokens` consecutive tokens from position position[0]: proj and out hold one row per token.
// conv_ring: [kernel, conv_dim]; conv_w: [conv_dim, kernel]; state: [value_heads, key_dim, value_dim].
// A single token (decode) also records its conv input in the ring; for several, deltanet_conv_ring
// does it afterwards (blocks run through the tokens at their own pace, and another block may
// still need the history a ring slot holds).
// Launch: value_heads * splits blocks in clusters of `splits`; cols = value_dim / splits columns
// per block, cols * groups threads, each owning key_dim / groups state rows of one column.
// Shared memory: (2 * key_dim + cols + threads + 32) floats.
extern "C" __global__ void __launch_bounds__(256) deltanet_step(DeltaNetDims d, const float* proj, float* conv_ring,
                                                              const float* conv_w, const float* a_log,
                                                              const float* dt_bias, const float* norm_w, float* state,
                                                              const int* position, int tokens, float* out) {
    extern __shared__ float smem[];
    __shared__ float partial_sq;
    const int h = blockIdx.x / d.splits, part = blockIdx.x % d.splits;
    const int ratio = d.value_heads / d.key_heads;
    const int kh = h / ratio;
    const int key_width = d.key_heads * d.key_dim;
    const int conv_dim = 2 * key_width + d.value_heads * d.value_dim;
    const int proj_width = deltanet_proj_width(d, conv_dim), out_width = d.value_heads * d.value_dim;
    const int cols = d.value_dim / d.splits, col0 = part * cols;

    // Everything but the projections was written by earlier steps or is a weight: the
    // recurrent state, the conv history and the per-head parameters are requested before waiting
    // for the projections. Thread (c, grp) owns state rows grp, grp + groups, ... of column
    // col0 + c.
    const int groups = blockDim.x / cols;
    const int c = threadIdx.x % cols, grp = threadIdx.x / cols, dv = col0 + c;
    const int rows = d.key_dim / groups;
    float* S = state + (size_t)h * d.key_dim * d.value_dim;
    float s[MAX_ROWS_PER_THREAD];
#pragma unroll
    for (int i = 0; i < MAX_ROWS_PER_THREAD; ++i)
        if (i < rows) s[i] = S[(grp + i * groups) * d.value_dim + dv];
    const int pos0 = position[0];
    const float head_decay = __expf(a_log[h]), head_dt_bias = dt_bias[h], norm_scale = norm_w[dv];

    float* q = smem;                 // [key_dim]
    float* k = q + d.key_dim;        // [key_dim]
    float* v = k + d.key_dim;        // [cols]
    float* red = v + cols;           // [groups, cols]
    float* scratch = red + blockDim.x;  // [32]

    // Causal conv + SiLU over the channels this block reads: its key head's q and k, its v
    // columns. At most 2 * key_dim + cols <= 2 * blockDim channels: two per thread, each with
    // its taps (back[m]: the tap for the input m steps back, 0 beyond the kernel) and its last
    // inputs (hist[j]: j + 1 steps back) in registers.
    const int nq = d.key_dim, channels = 2 * nq + cols;
    int conv_ch[2];
    float back[2][MAX_CONV_KERNEL], hist[2][MAX_CONV_KERNEL - 1];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = threadIdx.x + r * blockDim.x;
        int ch = 0;
        if (i < nq) ch = kh * d.key_dim + i;
        else if (i < 2 * nq) ch = key_width + kh * d.key_dim + (i - nq);
        else if (i < channels) ch = 2 * key_width + h * d.value_dim + col0 + (i - 2 * nq);
        conv_ch[r] = ch;
#pragma unroll
        for (int j = 0; j < MAX_CONV_KERNEL; ++j) {
            back[r][j] = j < d.kernel && i < channels ? conv_w[ch * d.kernel + d.kernel - 1 - j] : 0.0f;
            if (j < MAX_CONV_KERNEL - 1) {
                const int p = pos0 - 1 - j;
                const bool have = j < d.kernel - 1 && i < channels && p >= 0;
                hist[r][j] = have ? conv_ring[(p % d.kernel) * conv_dim + ch] : 0.0f;
            }
        }
    }
    wait_for_previous_kernel();

    for (int t = 0; t < tokens; ++t) {
        const float* row = proj + (size_t)t * proj_width;
        const float* zba = row + conv_dim;
        const float b = zba[d.value_heads * d.value_dim + h];
        const float a = zba[d.value_heads * d.value_dim + d.value_heads + h];
        const float z = zba[h * d.value_dim + dv];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = threadIdx.x + r * blockDim.x;
            if (i >= channels) continue;
            const int ch = conv_ch[r];
            const float cur = row[ch];
            float acc = back[r][0] * cur;
#pragma unroll
            for (int j = 1; j < MAX_CONV_KERNEL; ++j) acc += back[r][j] * hist[r][j - 1];
#pragma unroll
            for (int j = MAX_CONV_KERNEL - 2; j > 0; --j) hist[r][j] = hist[r][j - 1];
            hist[r][0] = cur;
            const float x = silu(acc);
            if (i < nq) q[i] = x;
            else if (i < 2 * nq) k[i - nq] = x;
            else v[i - 2 * nq] = x;
            // q/k channels are read by every block of `ratio` value heads: the first one records them.
            const bool owner = i >= 2 * nq || (h % ratio == 0 && part == 0);
            if (tokens == 1 && owner) conv_ring[(pos0 % d.kernel) * conv_dim + ch] = cur;
        }
        __syncthreads();

        // L2-normalise q and k; q also takes the 1/sqrt(key_dim) scale.
        float qs = 0.0f, ks = 0.0f;
        for (int i = threadIdx.x; i < nq; i += blockDim.x) { qs += q[i] * q[i]; ks += k[i] * k[i]; }
        qs = block_sum(qs, scratch);
        ks = block_sum(ks, scratch);
        const float qinv = rsqrtf(qs + 1e-6f) * rsqrtf((float)d.key_dim);
        const float kinv = rsqrtf(ks + 1e-6f);
        __syncthreads();
        for (int i = threadIdx.x; i < nq; i += blockDim.x) { q[i] *= qinv; k[i] *= kinv; }
        __syncthreads();

        const float beta = sigmoid(b);
        const float decay = __expf(-head_decay * softplus(a + head_dt_bias));

        float kv = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_ROWS_PER_THREAD; ++i) {
            if (i < rows) {
                const int dk = grp + i * groups;
                s[i] *= decay;
                kv += s[i] * k[dk];
            }
        }
        red[threadIdx.x] = kv;
        __syncthreads();
        kv = 0.0f;
        for (int g = 0; g < groups; ++g) kv += red[g * cols + c];
        const float delta = beta * (v[c] - kv);
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_ROWS_PER_THREAD; ++i) {
            if (i < rows) {
                const int dk = grp + i * groups;
                s[i] += k[dk] * delta;
                o += s[i] * q[dk];
            }
        }
        __syncthreads();
        red[threadIdx.x] = o;
        __syncthreads();
        o = 0.0f;
        for (int g = 0; g < groups; ++g) o += red[g * cols + c];

        // Gated RMSNorm over the head's value_dim columns: norm(o) * w * silu(z); the cluster's
        // blocks each hold `cols` of them.
        const float sq = block_sum(grp == 0 ? o * o : 0.0f, scratch);
        if (threadIdx.x == 0) partial_sq = sq;
        cluster_barrier();
        float total = 0.0f;
        for (int r = 0; r < d.splits; ++r) total += cluster_load(&partial_sq, r);
        // No block may go on (overwriting its partial, or leaving) while another still reads it.
        cluster_barrier();
        if (grp == 0) {
            const float inv = rsqrtf(total / d.value_dim + d.eps);
            out[(size_t)t * out_width + h * d.value_dim + dv] = o * inv * norm_scale * silu(z);
        }
    }
#pragma unroll
    for (int i = 0; i < MAX_ROWS_PER_THREAD; ++i)
        if (i < rows) S[(grp + i * groups) * d.value_dim + dv] = s[i];
}

// After a multi-token deltanet_step: records the last min(tokens, kernel) conv inputs (positions
// position[0] + tokens - kernel .. position[0] + tokens - 1) in the ring. Grid-stride over the
// conv channels.
extern "C" __global__ void __launch_bounds__(256) deltanet_conv_ring(DeltaNetDims d, const float* proj,
                                                                   float* conv_ring, const int* position,
                                                                   int tokens) {
    wait_for_previous_kernel();
    const int conv_dim = 2 * d.key_heads * d.key_dim + d.value_heads * d.value_dim;
    const int proj_width = deltanet_proj_width(d, conv_dim);
    const int pos0 = position[0];
    const int first = max(0, tokens - d.kernel);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (tokens - first) * conv_dim; i += gridDim.x * blockDim.x) {
        const int t = first + i / conv_dim, ch = i % conv_dim;
        conv_ring[((pos0 + t) % d.kernel) * conv_dim + ch] = proj[(size_t)t * proj_width + ch];
    }
}

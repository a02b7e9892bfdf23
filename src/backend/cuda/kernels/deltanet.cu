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

// Prefill of a chunk of `tokens` tokens in three parallel passes around one sequential scan:
// deltanet_conv_chunk (causal conv + SiLU of every channel of every token), deltanet_norm_chunk
// (q/k L2 norms, the gates), deltanet_scan (the recurrence: a warp owns 4 columns of a head's
// state, its lanes 4 rows each, so a token needs only warp reductions and the next token's
// inputs are loaded while this one is reduced), deltanet_gated_norm.

// act[t, ch] = silu(causal conv of channel ch at token t): the inputs before position[0] come
// from the ring. Grid: (ceil(conv_dim / 256), tokens).
extern "C" __global__ void __launch_bounds__(256) deltanet_conv_chunk(DeltaNetDims d, const float* proj,
                                                                    const float* conv_ring, const float* conv_w,
                                                                    const int* position, float* act) {
    wait_for_previous_kernel();
    const int conv_dim = 2 * d.key_heads * d.key_dim + d.value_heads * d.value_dim;
    const int proj_width = deltanet_proj_width(d, conv_dim);
    const int ch = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (ch >= conv_dim) return;
    const int pos0 = position[0];
    float acc = 0.0f;
    for (int j = 0; j < d.kernel; ++j) {
        // Tap kernel - 1 - j takes the input j steps back.
        const int back = t - j;
        float in = 0.0f;
        if (back >= 0) in = proj[(size_t)back * proj_width + ch];
        else if (pos0 + back >= 0) in = conv_ring[((pos0 + back) % d.kernel) * conv_dim + ch];
        acc += conv_w[ch * d.kernel + d.kernel - 1 - j] * in;
    }
    act[(size_t)t * conv_dim + ch] = silu(acc);
}

// L2-normalises each key head's q (also scaled by 1/sqrt(key_dim)) and k in act, and writes the
// gates of its value heads: gates[t, h] = (beta, decay). Grid: (key_heads, tokens), key_dim
// threads rounded up to whole warps.
extern "C" __global__ void __launch_bounds__(256) deltanet_norm_chunk(DeltaNetDims d, const float* proj,
                                                                    const float* a_log, const float* dt_bias,
                                                                    float* act, float2* gates) {
    __shared__ float scratch[32];
    wait_for_previous_kernel();
    const int kh = blockIdx.x, t = blockIdx.y, i = threadIdx.x;
    const int key_width = d.key_heads * d.key_dim;
    const int conv_dim = 2 * key_width + d.value_heads * d.value_dim;
    float* row = act + (size_t)t * conv_dim;
    const bool mine = i < d.key_dim;
    const float q = mine ? row[kh * d.key_dim + i] : 0.0f, k = mine ? row[key_width + kh * d.key_dim + i] : 0.0f;
    const float qs = block_sum(q * q, scratch);
    const float ks = block_sum(k * k, scratch);
    if (mine) {
        row[kh * d.key_dim + i] = q * rsqrtf(qs + 1e-6f) * rsqrtf((float)d.key_dim);
        row[key_width + kh * d.key_dim + i] = k * rsqrtf(ks + 1e-6f);
    }
    const int ratio = d.value_heads / d.key_heads;
    if (i < ratio) {
        const int h = kh * ratio + i;
        const float* zba = proj + (size_t)t * deltanet_proj_width(d, conv_dim) + conv_dim;
        const float b = zba[d.value_heads * d.value_dim + h];
        const float a = zba[d.value_heads * d.value_dim + d.value_heads + h];
        gates[(size_t)t * d.value_heads + h] = make_float2(sigmoid(b), __expf(-__expf(a_log[h]) * softplus(a + dt_bias[h])));
    }
}

// The gated delta rule over the chunk. Warp w owns columns 4w' .. 4w' + 3 of value head h (w'
// the warp's index within the head); lane l rows 4l .. 4l + 3 (key_dim a multiple of 4, at most
// 128; lanes past it hold zeros). Writes the raw output o[t, h, column] and leaves the state for
// the next chunk or decode. Grid: value_heads * value_dim / 4 warps, 8 per block.
extern "C" __global__ void __launch_bounds__(256) deltanet_scan(DeltaNetDims d, const float* act,
                                                              const float2* gates, float* state, int tokens,
                                                              float* o) {
    wait_for_previous_kernel();
    const int lane = threadIdx.x & 31;
    const int warp = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int warps_per_head = d.value_dim / 4;
    const int h = warp / warps_per_head, c0 = (warp % warps_per_head) * 4;
    if (h >= d.value_heads) return;
    const int kh = h / (d.value_heads / d.key_heads);
    const int key_width = d.key_heads * d.key_dim;
    const int conv_dim = 2 * key_width + d.value_heads * d.value_dim;
    const int r0 = 4 * lane;
    const bool rows_mine = r0 < d.key_dim;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float* S = state + (size_t)h * d.key_dim * d.value_dim;
    float s[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float4 v = rows_mine ? *reinterpret_cast<const float4*>(S + (size_t)(r0 + i) * d.value_dim + c0) : zero;
        s[i][0] = v.x; s[i][1] = v.y; s[i][2] = v.z; s[i][3] = v.w;
    }
    const size_t q_at = (size_t)kh * d.key_dim + r0, k_at = key_width + q_at;
    const size_t v_at = 2 * (size_t)key_width + (size_t)h * d.value_dim + c0;
    float4 q = rows_mine ? *reinterpret_cast<const float4*>(act + q_at) : zero;
    float4 k = rows_mine ? *reinterpret_cast<const float4*>(act + k_at) : zero;
    float4 v = *reinterpret_cast<const float4*>(act + v_at);
    float2 g = gates[h];
    for (int t = 0; t < tokens; ++t) {
        // The next token's inputs go out before this token's reductions.
        const int nt = min(t + 1, tokens - 1);
        const float* next = act + (size_t)nt * conv_dim;
        const float4 nq = rows_mine ? *reinterpret_cast<const float4*>(next + q_at) : zero;
        const float4 nk = rows_mine ? *reinterpret_cast<const float4*>(next + k_at) : zero;
        const float4 nv = *reinterpret_cast<const float4*>(next + v_at);
        const float2 ng = gates[(size_t)nt * d.value_heads + h];
        const float kr[4] = {k.x, k.y, k.z, k.w}, qr[4] = {q.x, q.y, q.z, q.w}, vc[4] = {v.x, v.y, v.z, v.w};
        float kv[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float part = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                s[i][j] *= g.y;
                part += s[i][j] * kr[i];
            }
            kv[j] = part;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) kv[j] = warp_sum(kv[j]);
        float out[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float delta = g.x * (vc[j] - kv[j]);
            float part = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                s[i][j] += kr[i] * delta;
                part += s[i][j] * qr[i];
            }
            out[j] = part;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) out[j] = warp_sum(out[j]);
        if (lane == 0)
            *reinterpret_cast<float4*>(o + (size_t)t * d.value_heads * d.value_dim + (size_t)h * d.value_dim + c0) =
                make_float4(out[0], out[1], out[2], out[3]);
        q = nq; k = nk; v = nv; g = ng;
    }
    if (rows_mine)
#pragma unroll
        for (int i = 0; i < 4; ++i)
            *reinterpret_cast<float4*>(S + (size_t)(r0 + i) * d.value_dim + c0) =
                make_float4(s[i][0], s[i][1], s[i][2], s[i][3]);
}

// out[t, h] = RMSNorm(o[t, h]) * norm_w * silu(z[t, h]) over each head's value_dim outputs.
// Grid: (value_heads, tokens), value_dim threads rounded up to whole warps.
extern "C" __global__ void __launch_bounds__(256) deltanet_gated_norm(DeltaNetDims d, const float* o, const float* proj,
                                                                    const float* norm_w, float* out) {
    __shared__ float scratch[32];
    wait_for_previous_kernel();
    const int h = blockIdx.x, t = blockIdx.y, i = threadIdx.x;
    const int conv_dim = 2 * d.key_heads * d.key_dim + d.value_heads * d.value_dim;
    const bool mine = i < d.value_dim;
    const size_t at = (size_t)t * d.value_heads * d.value_dim + (size_t)h * d.value_dim + i;
    const float x = mine ? o[at] : 0.0f;
    const float ss = block_sum(x * x, scratch);
    if (!mine) return;
    const float z = proj[(size_t)t * deltanet_proj_width(d, conv_dim) + conv_dim + h * d.value_dim + i];
    out[at] = x * rsqrtf(ss / d.value_dim + d.eps) * norm_w[i] * silu(z);
}

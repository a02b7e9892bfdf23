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
#define MAX_SPLITS 4  // blocks per head (DeltaNetShape on the host)
// deltanet_step's launch bounds; DELTANET_STEP_BLOCKS (an experiment) caps its registers for
// that many blocks per SM.
#ifdef DELTANET_STEP_BLOCKS
#define DELTANET_STEP_BOUNDS __launch_bounds__(256, DELTANET_STEP_BLOCKS)
#else
#define DELTANET_STEP_BOUNDS __launch_bounds__(256)
#endif
#ifndef DELTANET_BATCHED_BLOCKS
#define DELTANET_BATCHED_BLOCKS 4  // blocks per SM of deltanet_step_batched
#endif

struct DeltaNetDims {
    int key_heads, value_heads, key_dim, value_dim, kernel, splits;
    float eps;
};

__device__ __forceinline__ void cluster_barrier() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Stores v at `local` (a shared-memory variable of this block) in block `rank` of the cluster.
__device__ __forceinline__ void cluster_store(float* local, uint32_t rank, float v) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(shared_address(local)), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
}

// Floats of one token's projection: [conv_dim (q|k|v) | z (value_heads*value_dim) |
// b (value_heads) | a (value_heads)].
__device__ __forceinline__ int deltanet_proj_width(const DeltaNetDims& d, int conv_dim) {
    return conv_dim + d.value_heads * d.value_dim + 2 * d.value_heads;
}

// The per-sequence buffers of a batched decode step (see seq_buffer): all null for one sequence.
struct DeltaNetSeqs {
    const unsigned long long* conv;
    const unsigned long long* state;
    const unsigned long long* position;
};

// The step's dimensions, with the model's DeltaNet shape in place of `given` where it is compiled
// in (GDN_KEY_DIM and the rest defined): the step's index arithmetic then folds to constants.
__device__ __forceinline__ DeltaNetDims deltanet_shape(DeltaNetDims given) {
#ifdef GDN_KEY_DIM
    given.key_heads = GDN_KEY_HEADS;
    given.value_heads = GDN_VALUE_HEADS;
    given.key_dim = GDN_KEY_DIM;
    given.value_dim = GDN_VALUE_DIM;
    given.kernel = GDN_CONV_KERNEL;
    given.splits = GDN_SPLITS;
#endif
    return given;
}

// deltanet_step's threads per block (blockDim.x), compiled in with the shape.
__device__ __forceinline__ int deltanet_step_threads() {
#ifdef GDN_STEP_THREADS
    return GDN_STEP_THREADS;
#else
    return blockDim.x;
#endif
}

// `tokens` consecutive tokens from position position[0]: proj and out hold one row per token.
// Batched (seqs non-null; one token each): blockIdx.z is the row, whose sequence's conv ring,
// state and position come from the tables.
// conv_ring: [kernel, conv_dim]; conv_w: [conv_dim, kernel]; state: [value_heads, key_dim, value_dim].
// A single token (decode) also records its conv input in the ring; for several, deltanet_conv_ring
// does it afterwards (blocks run through the tokens at their own pace, and another block may
// still need the history a ring slot holds).
// Launch: value_heads * splits blocks in clusters of `splits`; cols = value_dim / splits columns
// per block, cols * groups threads, each owning key_dim / groups state rows of one column.
// Shared memory: (2 * key_dim + cols + threads + 64) floats.
__device__ __forceinline__ void deltanet_step_impl(const DeltaNetDims& given, const float* proj, float* conv_ring,
                                                   const float* conv_w, const float* a_log, const float* dt_bias,
                                                   const float* norm_w, float* state, const int* position,
                                                   int tokens, float* out, const DeltaNetSeqs& seqs) {
    extern __shared__ float smem[];
    const DeltaNetDims d = deltanet_shape(given);
    const int threads = deltanet_step_threads();
    // Sums of squares of the head's output, per token parity, block of the cluster and warp of
    // group 0 (cols <= 256, splits <= MAX_SPLITS): every block pushes its own to all.
    __shared__ float partial_sq[2][MAX_SPLITS][8];
    // Distributed shared memory may be written only once every block of the cluster runs.
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    const int h = div_fast(blockIdx.x, d.splits), part = mod_fast(blockIdx.x, d.splits);
    const int ratio = div_fast(d.value_heads, d.key_heads);
    const int kh = div_fast(h, ratio);
    const int key_width = d.key_heads * d.key_dim;
    const int conv_dim = 2 * key_width + d.value_heads * d.value_dim;
    const int proj_width = deltanet_proj_width(d, conv_dim), out_width = d.value_heads * d.value_dim;
    const int cols = div_fast(d.value_dim, d.splits), col0 = part * cols;
    const int row_of_batch = blockIdx.z;
    conv_ring = seq_buffer(conv_ring, seqs.conv, row_of_batch);
    state = seq_buffer(state, seqs.state, row_of_batch);
    position = seq_buffer(position, seqs.position, row_of_batch);
    proj += (size_t)row_of_batch * proj_width;
    out += (size_t)row_of_batch * out_width;

    // Everything but the projections was written by earlier steps or is a weight: the
    // recurrent state, the conv history and the per-head parameters are requested before waiting
    // for the projections. Thread (c, grp) owns state rows grp, grp + groups, ... of column
    // col0 + c.
    const int groups = div_fast(threads, cols);
    const int c = mod_fast(threadIdx.x, cols), grp = div_fast(threadIdx.x, cols), dv = col0 + c;
    const int rows = div_fast(d.key_dim, groups);
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
    float* scratch = red + threads;  // [64]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = threads >> 5;

    // Causal conv + SiLU over the channels this block reads: its key head's q and k, its v
    // columns. At most 2 * key_dim + cols <= 2 * blockDim channels: two per thread, each with
    // its taps (back[m]: the tap for the input m steps back, 0 beyond the kernel) and its last
    // inputs (hist[j]: j + 1 steps back) in registers.
    const int nq = d.key_dim, channels = 2 * nq + cols;
    int conv_ch[2];
    float back[2][MAX_CONV_KERNEL], hist[2][MAX_CONV_KERNEL - 1];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = threadIdx.x + r * threads;
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
                hist[r][j] = have ? conv_ring[mod_fast(p, d.kernel) * conv_dim + ch] : 0.0f;
            }
        }
    }
    wait_for_previous_kernel();
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");

    for (int t = 0; t < tokens; ++t) {
        const float* row = proj + (size_t)t * proj_width;
        const float* zba = row + conv_dim;
        const float b = zba[d.value_heads * d.value_dim + h];
        const float a = zba[d.value_heads * d.value_dim + d.value_heads + h];
        const float z = zba[h * d.value_dim + dv];
        // This thread's share of the squares of q and k (for their L2 norms).
        float qs = 0.0f, ks = 0.0f;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = threadIdx.x + r * threads;
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
            if (i < nq) {
                q[i] = x;
                qs += x * x;
            } else if (i < 2 * nq) {
                k[i - nq] = x;
                ks += x * x;
            } else {
                v[i - 2 * nq] = x;
            }
            // q/k channels are read by every block of `ratio` value heads: the first one records them.
            const bool owner = i >= 2 * nq || (mod_fast(h, ratio) == 0 && part == 0);
            if (tokens == 1 && owner) conv_ring[mod_fast(pos0, d.kernel) * conv_dim + ch] = cur;
        }
        qs = warp_sum(qs);
        ks = warp_sum(ks);
        if (lane == 0) {
            scratch[warp] = qs;
            scratch[32 + warp] = ks;
        }
        __syncthreads();
        // The L2 norms of q and k (q also takes the 1/sqrt(key_dim) scale) are applied to the
        // products below, which are linear in each, rather than to q and k themselves.
        qs = ks = 0.0f;
        for (int w = 0; w < warps; ++w) {
            qs += scratch[w];
            ks += scratch[32 + w];
        }
        const float qinv = rsqrtf(qs + 1e-6f) * rsqrtf((float)d.key_dim);
        const float kinv = rsqrtf(ks + 1e-6f);

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
        const float delta = beta * (v[c] - kv * kinv);
        const float k_delta = kinv * delta;
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_ROWS_PER_THREAD; ++i) {
            if (i < rows) {
                const int dk = grp + i * groups;
                s[i] += k[dk] * k_delta;
                o += s[i] * q[dk];
            }
        }
        __syncthreads();
        red[threadIdx.x] = o;
        __syncthreads();
        o = 0.0f;
        for (int g = 0; g < groups; ++g) o += red[g * cols + c];
        o *= qinv;

        // Gated RMSNorm over the head's value_dim columns: norm(o) * w * silu(z); the cluster's
        // blocks each hold `cols` of them, group 0 (the first `cols` threads) one each.
        // One cluster barrier per token: the partials are pushed (so no block reads another's
        // shared memory after it), and alternate buffers by token parity (a block can be at
        // most one token ahead of another: it passes token t's barrier only once every block
        // has finished token t - 1).
        float (*sums)[8] = partial_sq[t & 1];
        if (warp < (cols + 31) / 32) {
            const float sq = warp_sum(grp == 0 ? o * o : 0.0f);
            if (lane < d.splits) cluster_store(&sums[part][warp], lane, sq);
        }
        cluster_barrier();
        float total = 0.0f;
        for (int r = 0; r < d.splits; ++r)
            for (int w = 0; w < (cols + 31) / 32; ++w) total += sums[r][w];
        if (grp == 0) {
            const float inv = rsqrtf(total / d.value_dim + d.eps);
            out[(size_t)t * out_width + h * d.value_dim + dv] = o * inv * norm_scale * silu(z);
        }
    }
#pragma unroll
    for (int i = 0; i < MAX_ROWS_PER_THREAD; ++i)
        if (i < rows) S[(grp + i * groups) * d.value_dim + dv] = s[i];
}

extern "C" __global__ void DELTANET_STEP_BOUNDS deltanet_step(DeltaNetDims d, const float* proj, float* conv_ring,
                                                              const float* conv_w, const float* a_log,
                                                              const float* dt_bias, const float* norm_w, float* state,
                                                              const int* position, int tokens, float* out,
                                                              DeltaNetSeqs seqs) {
    TRACE_BLOCK();
    deltanet_step_impl(d, proj, conv_ring, conv_w, a_log, dt_bias, norm_w, state, position, tokens, out, seqs);
}

// deltanet_step for batched decode steps, whose blocks (a grid row per sequence) run in several
// waves: registers capped (64, no spills) so that four blocks share an SM instead of two, in
// fewer waves. One sequence keeps deltanet_step, whose 125 registers hold more of its loads in
// flight before its wait. The same code, so each sequence's step is bit for bit what it is alone.
extern "C" __global__ void __launch_bounds__(256, DELTANET_BATCHED_BLOCKS) deltanet_step_batched(DeltaNetDims d, const float* proj,
                                                                         float* conv_ring, const float* conv_w,
                                                                         const float* a_log, const float* dt_bias,
                                                                         const float* norm_w, float* state,
                                                                         const int* position, int tokens, float* out,
                                                                         DeltaNetSeqs seqs) {
    TRACE_BLOCK();
    deltanet_step_impl(d, proj, conv_ring, conv_w, a_log, dt_bias, norm_w, state, position, tokens, out, seqs);
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

// Prefill of a chunk of `tokens` tokens: deltanet_conv_chunk (causal conv + SiLU of every channel
// of every token) and deltanet_norm_chunk (q/k L2 norms, the gates) in parallel over the tokens;
// the recurrence in the chunkwise form below (deltanet_chunk_prepare, deltanet_chunk_state,
// deltanet_chunk_output), or token by token in deltanet_scan for heads that form does not take;
// then deltanet_gated_norm in parallel again.

#define CONV_RUN 16 // consecutive tokens per thread of deltanet_conv_chunk

// act[t, ch] = silu(causal conv of channel ch at token t): the inputs before position[0] come
// from the ring. A thread takes one channel over CONV_RUN consecutive tokens, with the taps and
// the last inputs in registers, so each input is read once. Grid: (ceil(conv_dim / 256),
// ceil(tokens / CONV_RUN)).
extern "C" __global__ void __launch_bounds__(256) deltanet_conv_chunk(DeltaNetDims d, const float* proj,
                                                                    const float* conv_ring, const float* conv_w,
                                                                    const int* position, int tokens, float* act) {
    wait_for_previous_kernel();
    const int conv_dim = 2 * d.key_heads * d.key_dim + d.value_heads * d.value_dim;
    const int proj_width = deltanet_proj_width(d, conv_dim);
    const int ch = blockIdx.x * blockDim.x + threadIdx.x, t0 = blockIdx.y * CONV_RUN;
    if (ch >= conv_dim) return;
    const int pos0 = position[0], K = d.kernel;
    // The input `back` tokens into the chunk (negative: from the ring, zero before the sequence).
    const auto input = [&](int back) {
        if (back >= 0) return proj[(size_t)back * proj_width + ch];
        return pos0 + back >= 0 ? conv_ring[((pos0 + back) % K) * conv_dim + ch] : 0.0f;
    };
    // tap[j]: the weight of the input j tokens back (tap K - 1 - j of the filter; 0 past it);
    // past[i]: the input MAX_CONV_KERNEL - 1 - i tokens before the current one.
    float tap[MAX_CONV_KERNEL], past[MAX_CONV_KERNEL - 1];
#pragma unroll
    for (int j = 0; j < MAX_CONV_KERNEL; ++j) tap[j] = j < K ? conv_w[ch * K + K - 1 - j] : 0.0f;
#pragma unroll
    for (int i = 0; i < MAX_CONV_KERNEL - 1; ++i) {
        const int back = MAX_CONV_KERNEL - 1 - i;
        past[i] = back < K ? input(t0 - back) : 0.0f;
    }
    const int end = min(t0 + CONV_RUN, tokens);
    for (int t = t0; t < end; ++t) {
        const float cur = proj[(size_t)t * proj_width + ch];
        float acc = tap[0] * cur;
#pragma unroll
        for (int j = 1; j < MAX_CONV_KERNEL; ++j) acc += tap[j] * past[MAX_CONV_KERNEL - 1 - j];
#pragma unroll
        for (int i = 0; i + 1 < MAX_CONV_KERNEL - 1; ++i) past[i] = past[i + 1];
        past[MAX_CONV_KERNEL - 2] = cur;
        act[(size_t)t * conv_dim + ch] = silu(acc);
    }
}

// L2-normalises each key head's q (also scaled by 1/sqrt(key_dim)) and k in act, and writes the
// gates of its value heads: gates[t, h] = (beta, g), g <= 0 the log of the decay (a log, so
// that the chunkwise form never takes the log of an underflowed decay). One warp per (token,
// key head), 8 per block. Grid: ceil(tokens * key_heads / 8), 256 threads.
extern "C" __global__ void __launch_bounds__(256) deltanet_norm_chunk(DeltaNetDims d, const float* proj,
                                                                    const float* a_log, const float* dt_bias,
                                                                    int tokens, float* act, float2* gates) {
    wait_for_previous_kernel();
    const int lane = threadIdx.x & 31, item = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (item >= tokens * d.key_heads) return;
    const int t = item / d.key_heads, kh = item % d.key_heads;
    const int key_width = d.key_heads * d.key_dim;
    const int conv_dim = 2 * key_width + d.value_heads * d.value_dim;
    float* q = act + (size_t)t * conv_dim + kh * d.key_dim;
    float* k = q + key_width;
    float qs = 0.0f, ks = 0.0f;
    for (int i = lane; i < d.key_dim; i += 32) {
        qs += q[i] * q[i];
        ks += k[i] * k[i];
    }
    qs = warp_sum(qs);
    ks = warp_sum(ks);
    const float q_scale = rsqrtf(qs + 1e-6f) * rsqrtf((float)d.key_dim), k_scale = rsqrtf(ks + 1e-6f);
    for (int i = lane; i < d.key_dim; i += 32) {
        q[i] *= q_scale;
        k[i] *= k_scale;
    }
    const int ratio = d.value_heads / d.key_heads;
    for (int i = lane; i < ratio; i += 32) {
        const int h = kh * ratio + i;
        const float* zba = proj + (size_t)t * deltanet_proj_width(d, conv_dim) + conv_dim;
        const float b = zba[d.value_heads * d.value_dim + h];
        const float a = zba[d.value_heads * d.value_dim + d.value_heads + h];
        gates[(size_t)t * d.value_heads + h] = make_float2(sigmoid(b), -__expf(a_log[h]) * softplus(a + dt_bias[h]));
    }
}

// The gated delta rule over the chunk token by token, for heads the chunkwise form does not take
// (chunked_fits in prefill.rs). Warp w owns columns 4w' .. 4w' + 3 of value head h (w'
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
        const float decay = __expf(g.y);
        float kv[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float part = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                s[i][j] *= decay;
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

// ---- The chunkwise gated delta rule ----
//
// The chunk's tokens in sub-chunks of GDN_CHUNK = 64 (the last one partial: its missing tokens
// count as q = k = v = 0, beta = 0, g = 0). Within a sub-chunk, with G_i the sum of g over its
// tokens up to i (so exp(G_i - G_j) is the decay from after token j to token i), the
// recurrence from the state S at the sub-chunk's start is
//   A[i, j] = beta_i exp(G_i - G_j) (k_i . k_j) for j < i, else 0;  T = (I + A)^-1
//   W = T (beta exp(G) K),  U = T (beta V)              (deltanet_chunk_prepare)
//   V' = U - W S    (the tokens' delta-rule updates, beta_i (v_i - (decayed S)^T k_i))
//   O = exp(G) (Q S) + (tril(Q K^T) ⊙ exp(G_i - G_j)) V'
//   S <- exp(G_last) S + K^T (exp(G_last - G) V')    (deltanet_chunk_state: all but the
//                                                     intra-sub-chunk term of O, added by
//                                                     deltanet_chunk_output)
// The products run on tensor cores as 3xTF32 (each fp32 operand split into a tf32 value and a
// tf32 remainder; hi*hi + hi*lo + lo*hi), close to fp32 accuracy: the state carries every
// error into later tokens. G is summed in fp64: after a large decay G is large, and in fp32 the
// differences G_i - G_j of the tokens after it would lose their low bits (a relative error of
// 1e-3 in exp(G_i - G_j) after a g of -1e4). key_dim and value_dim are multiples of 16, at most
// 128. The kernels stage their inputs in shared memory with cp.async; mma fragments are read from
// there, rows padded so that a warp's fragment reads hit 32 distinct banks.

#define GDN_CHUNK 64
#define GDN_STATE_STRIDE 40   // row stride (floats) of deltanet_chunk_state's state, U and V' tiles
#define GDN_A_STRIDE 68       // row stride of 64-wide token x token tiles in shared memory

// Value columns of a head's state per deltanet_chunk_state block: 32, or 16 where value_dim is
// not a multiple of 32.
__device__ __forceinline__ int gdn_state_cols(int value_dim) { return value_dim % 32 == 0 ? 32 : 16; }

__device__ __forceinline__ void cp_async_8(double* dst, const double* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(shared_address(dst)), "l"(src) : "memory");
}


// The whole block: cp.async of a sub-chunk's 64 rows of `width` floats (a multiple of 4; rows
// 16-byte aligned) from src (row stride src_stride) to dst (row stride dst_stride); rows from
// `valid` on get zeros and are not read.
__device__ __forceinline__ void copy_sub_chunk(float* dst, int dst_stride, const float* src, size_t src_stride,
                                               int width, int valid) {
    const int chunks = width / 4;
    for (int i = threadIdx.x; i < GDN_CHUNK * chunks; i += blockDim.x) {
        const int r = i / chunks, c = 4 * (i % chunks);
        const bool here = r < valid;
        cp_async_16(shared_address(dst + r * dst_stride + c), src + (here ? r : 0) * src_stride + c, here);
    }
}

// x as the sum of two tf32 operands for 3xTF32: hi is x rounded to tf32 (half an ulp added to the
// magnitude, the low 13 mantissa bits cleared), lo = x - hi exactly; mma reads only the top 10
// mantissa bits of lo, so hi + lo is x to ~2^-21 relative. Three instructions, where
// cvt.rna.tf32.f32 (emulated on sm_90: add, compare with inf, select, mask) took nine for the
// pair. For finite inputs.
struct Tf32Pair {
    uint32_t hi, lo;
};

__device__ __forceinline__ Tf32Pair tf32_split(float x) {
    const uint32_t hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    return {hi, __float_as_uint(x - __uint_as_float(hi))};
}

__device__ __forceinline__ void mma_tf32_1688(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// One warp: acc[n] += A B_n over `ksteps` * 8 inner indices, A a 16-row tile read through
// a(row, k) (row < 16), B_n the n-th 8-column tile of B read through b(k, col) (col < 8 * tiles),
// for the first `tiles` <= NT tiles, in 3xTF32: hi*hi into acc, the two cross terms into
// accumulators of their own (added at the end, small ones first), so that consecutive mma
// instructions do not wait for each other's results. Accumulator element r of a lane
// (g = lane / 4, c = lane % 4) is row g + 8 * (r / 2), column 2c + r % 2 of its tile
// (gdn_acc_row / gdn_acc_col).
template <int NT, typename LoadA, typename LoadB>
__device__ __forceinline__ void warp_product_3xtf32(float (&acc)[NT][4], int ksteps, LoadA a, LoadB b,
                                                    int tiles = NT) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    float lo_hi[NT][4] = {}, hi_lo[NT][4] = {};
    for (int s = 0; s < ksteps; ++s) {
        const int k = 8 * s + c;
        const float af[4] = {a(g, k), a(g + 8, k), a(g, k + 4), a(g + 8, k + 4)};
        uint32_t ah[4], al[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const Tf32Pair p = tf32_split(af[r]);
            ah[r] = p.hi;
            al[r] = p.lo;
        }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            if (n >= tiles) continue;
            const Tf32Pair b0 = tf32_split(b(k, 8 * n + g)), b1 = tf32_split(b(k + 4, 8 * n + g));
            const uint32_t bh[2] = {b0.hi, b1.hi}, bl[2] = {b0.lo, b1.lo};
            mma_tf32_1688(lo_hi[n], al, bh);
            mma_tf32_1688(hi_lo[n], ah, bl);
            mma_tf32_1688(acc[n], ah, bh);
        }
    }
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[n][r] += lo_hi[n][r] + hi_lo[n][r];
}

__device__ __forceinline__ int gdn_acc_row(int r) { return ((threadIdx.x & 31) >> 2) + 8 * (r >> 1); }
__device__ __forceinline__ int gdn_acc_col(int r) { return 2 * (threadIdx.x & 3) + (r & 1); }

// The block's 8 warps: out[i, j] = weight(i, j, x_i . k_j) for the sub-chunk's 64 x 64 token
// pairs, x and k tiles of 64 rows of kd values `stride` apart; warp w computes rows
// 16 (w / 2) .. + 16, columns 32 (w % 2) .. + 32. `weight` applies the mask and the decays.
template <typename Weight>
__device__ __forceinline__ void token_pair_products(const float* x_tile, const float* k_tile, int stride, int kd,
                                                    float* out, Weight weight) {
    const int warp = threadIdx.x >> 5;
    const int i0 = 16 * (warp >> 1), j0 = 32 * (warp & 1);
    float acc[4][4] = {};
    warp_product_3xtf32<4>(
        acc, kd / 8, [&](int r, int k) { return x_tile[(i0 + r) * stride + k]; },
        [&](int k, int c) { return k_tile[(j0 + c) * stride + k]; });
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int i = i0 + gdn_acc_row(r), j = j0 + 8 * n + gdn_acc_col(r);
            out[i * GDN_A_STRIDE + j] = weight(i, j, acc[n][r]);
        }
}

// Per (value head h, sub-chunk): the cumulative log decays gcum[t, h] = G_t of its tokens, and
// W = T (beta exp(G) K) into w[t, h, :key_dim], U = T (beta V) into values[t, h, :value_dim]
// (every row of the sub-chunk: missing tokens get zeros, so the buffers hold whole sub-chunks).
// T = (I + A)^-1 is applied by forward substitution, one column of [W | U] per thread, the
// column's 64 values in registers; A = K K^T comes from the tensor cores. The sub-chunk's k and
// v rows are copied to shared memory (cp.async) while G is summed.
// Grid: (value_heads, ceil(tokens / 64)), 256 threads (8 warps: a 16 x 32 tile of A each).
// Dynamic shared memory: (64 * (key_dim + 4) + 64 * value_dim + 64 * GDN_A_STRIDE + 4 * 64)
// floats.
extern "C" __global__ void __launch_bounds__(256) deltanet_chunk_prepare(DeltaNetDims d, const float* act,
                                                                       const float2* gates, int tokens, double* gcum,
                                                                       float* w, float* values) {
    extern __shared__ float smem[];
    const int kd = d.key_dim, vd = d.value_dim, heads = d.value_heads;
    const int h = blockIdx.x, t0 = blockIdx.y * GDN_CHUNK, present = min(GDN_CHUNK, tokens - t0);
    const int kh = h / (heads / d.key_heads);
    const int key_width = d.key_heads * kd, conv_dim = 2 * key_width + heads * vd;
    const int k_stride = kd + 4;  // mma fragment reads of a warp then hit 32 distinct banks
    float* k_tile = smem;                          // [64, key_dim (+4)]: the tokens' k
    float* v_tile = k_tile + GDN_CHUNK * k_stride; // [64, value_dim]: the tokens' v
    float* a_tile = v_tile + GDN_CHUNK * vd;       // [64, 64 (+4)]: A
    double* G = reinterpret_cast<double*>(a_tile + GDN_CHUNK * GDN_A_STRIDE); // [64] (8-byte aligned: even offset)
    float* beta = reinterpret_cast<float*>(G + GDN_CHUNK); // [64]
    float* beta_decay = beta + GDN_CHUNK;          // [64]: beta_i exp(G_i)
    wait_for_previous_kernel();

    const float* rows = act + (size_t)t0 * conv_dim;
    copy_sub_chunk(k_tile, k_stride, rows + key_width + kh * kd, conv_dim, kd, present);
    copy_sub_chunk(v_tile, vd, rows + 2 * key_width + h * vd, conv_dim, vd, present);
    cp_async_commit();
    // G: an inclusive scan of g, per warp of 32 tokens, then the second warp adds the first's total.
    if (threadIdx.x < GDN_CHUNK) {
        const int t = threadIdx.x, lane = t & 31;
        const float2 gate = t < present ? gates[(size_t)(t0 + t) * heads + h] : make_float2(0.0f, 0.0f);
        double sum = gate.y;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const double up = __shfl_up_sync(0xffffffffu, sum, off);
            if (lane >= off) sum += up;
        }
        beta[t] = gate.x;
        G[t] = sum;
    }
    cp_async_wait<0>();
    __syncthreads();
    if (threadIdx.x >= 32 && threadIdx.x < GDN_CHUNK) G[threadIdx.x] += G[31];
    __syncthreads();
    if (threadIdx.x < GDN_CHUNK) {
        const int t = threadIdx.x;
        beta_decay[t] = beta[t] * expf((float)G[t]);
        if (t < present) gcum[(size_t)(t0 + t) * heads + h] = G[t];
    }

    // A[i, j] = beta_i exp(G_i - G_j) (k_i . k_j) below the diagonal.
    token_pair_products(k_tile, k_tile, k_stride, kd, a_tile, [&](int i, int j, float kk) {
        return j < i ? beta[i] * expf((float)(G[i] - G[j])) * kk : 0.0f;
    });
    __syncthreads();

    // Forward substitution: x_i = rhs_i - sum_{j < i} A[i, j] x_j down one column of [W | U]
    // (A is zero on and above the diagonal, so whole float4s of a row can be read).
    for (int col = threadIdx.x; col < kd + vd; col += blockDim.x) {
        const bool is_w = col < kd;
        // rhs_i = scale[i] * src[i * stride]: beta exp(G) k from k_tile, or beta v from v_tile.
        const float* src = is_w ? k_tile + col : v_tile + (col - kd);
        const int stride = is_w ? k_stride : vd;
        const float* scale = is_w ? beta_decay : beta;
        float x[GDN_CHUNK];
#pragma unroll
        for (int i = 0; i < GDN_CHUNK; ++i) {
            float r = i < present ? scale[i] * src[i * stride] : 0.0f;
            const float* a_row = a_tile + i * GDN_A_STRIDE;
#pragma unroll
            for (int j = 0; j < i; j += 4) {
                const float4 a4 = *reinterpret_cast<const float4*>(a_row + j);
                r -= a4.x * x[j];
                if (j + 1 < i) r -= a4.y * x[j + 1];
                if (j + 2 < i) r -= a4.z * x[j + 2];
                if (j + 3 < i) r -= a4.w * x[j + 3];
            }
            x[i] = r;
        }
        float* dst = is_w ? w + ((size_t)t0 * heads + h) * kd + col : values + ((size_t)t0 * heads + h) * vd + (col - kd);
        const size_t row_stride = is_w ? (size_t)heads * kd : (size_t)heads * vd;
#pragma unroll
        for (int i = 0; i < GDN_CHUNK; ++i) dst[i * row_stride] = x[i];
    }
}

// The sequential part, per (value head h, cols = gdn_state_cols(value_dim) of its value columns):
// the columns' state through the sub-chunks in order. For each sub-chunk it turns U into
// V' = U - W S in place in `values`, writes o = exp(G) (Q S) (the part of the output that comes
// from the state at the sub-chunk's start) and moves the state on; the final state goes back to
// `state`. Warp w works on 16 columns, 16 (w % 2) .. + 15 (as far as the block has them): warps
// 0-7 compute V' for tokens 16 (w / 2) .. + 15, warps 8-15 o for tokens 16 (w / 2 - 4) .. + 15,
// both from the state in shared memory; warp w then updates state rows 16 (w / 2) .. + 15, which
// it keeps in registers, and copies them to shared memory for the next sub-chunk. The products
// are chains of dependent tensor-core and conversion instructions: 16 warps rather than 8 give
// each scheduler twice the chains to interleave. The inputs are copied with cp.async a phase
// ahead: W, Q, U and G of the next sub-chunk while this one's state update runs, K of this
// sub-chunk while its V' and o run.
// Grid: value_heads * value_dim / cols blocks of 512 threads (16 warps).
// Dynamic shared memory: (2 * 64 * (key_dim + 4) + 64 * (key_dim + 8) + (128 + key_dim) *
// GDN_STATE_STRIDE) floats and 64 doubles (141 KiB at key_dim 128).
extern "C" __global__ void __launch_bounds__(512) deltanet_chunk_state(DeltaNetDims d, const float* act,
                                                                     const double* gcum, const float* w,
                                                                     float* values, float* state, int tokens,
                                                                     float* o) {
    extern __shared__ float smem[];
    const int kd = d.key_dim, vd = d.value_dim, heads = d.value_heads;
    const int cols = gdn_state_cols(vd), col_tiles = cols / 8, slices = vd / cols;
    const int h = blockIdx.x / slices, col0 = (blockIdx.x % slices) * cols;
    const int kh = h / (heads / d.key_heads);
    const int key_width = d.key_heads * kd, conv_dim = 2 * key_width + heads * vd;
    const int warp = threadIdx.x >> 5, rows16 = warp >> 1;
    // This warp's 8-column tiles: c_base .. c_base + 15, `tiles` of them within the block's.
    const int c_base = 16 * (warp & 1), tiles = max(0, min(2, col_tiles - 2 * (warp & 1)));
    // Row strides: W and Q are read as A fragments (row, k): 4 mod 32 banks apart; K is read
    // transposed and the others as B fragments (k, column): 8 mod 32 apart.
    const int a_stride = kd + 4, k_stride = kd + 8;
    float* w_tile = smem;                                 // [64, key_dim (+4)]: W
    float* q_tile = w_tile + GDN_CHUNK * a_stride;        // [64, key_dim (+4)]: Q
    float* k_tile = q_tile + GDN_CHUNK * a_stride;        // [64, key_dim (+8)]: K
    float* u_tile = k_tile + GDN_CHUNK * k_stride;        // [64, cols (+)]: U
    float* v_new = u_tile + GDN_CHUNK * GDN_STATE_STRIDE; // [64, cols (+)]: exp(G_last - G_t) V'[t]
    float* s = v_new + GDN_CHUNK * GDN_STATE_STRIDE;      // [key_dim, cols (+)]: the state
    double* G = reinterpret_cast<double*>(s + kd * GDN_STATE_STRIDE); // [64] (8-byte aligned: even offset)
    const auto load_wqug = [&](int t0) {
        const int present = min(GDN_CHUNK, tokens - t0);
        // deltanet_chunk_prepare wrote whole sub-chunks of W and U; act and gcum hold `present` rows.
        copy_sub_chunk(w_tile, a_stride, w + ((size_t)t0 * heads + h) * kd, (size_t)heads * kd, kd, GDN_CHUNK);
        copy_sub_chunk(q_tile, a_stride, act + (size_t)t0 * conv_dim + kh * kd, conv_dim, kd, present);
        copy_sub_chunk(u_tile, GDN_STATE_STRIDE, values + ((size_t)t0 * heads + h) * vd + col0, (size_t)heads * vd,
                       cols, GDN_CHUNK);
        if (threadIdx.x < present) cp_async_8(G + threadIdx.x, gcum + (size_t)(t0 + threadIdx.x) * heads + h);
    };
    const auto load_k = [&](int t0) {
        copy_sub_chunk(k_tile, k_stride, act + (size_t)t0 * conv_dim + key_width + kh * kd, conv_dim, kd,
                       min(GDN_CHUNK, tokens - t0));
    };
    wait_for_previous_kernel();
    load_wqug(0);
    cp_async_commit();
    load_k(0);
    cp_async_commit();

    // The warp's state rows and columns (none past key_dim), as mma accumulators.
    const bool owns_rows = 16 * rows16 < kd;
    const int i0 = 16 * rows16;
    float* S = state + (size_t)h * kd * vd + col0;
    float st[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int i = i0 + gdn_acc_row(r), c = c_base + 8 * n + gdn_acc_col(r);
            st[n][r] = owns_rows && n < tiles ? S[(size_t)i * vd + c] : 0.0f;
            if (owns_rows && n < tiles) s[i * GDN_STATE_STRIDE + c] = st[n][r];
        }

    for (int t0 = 0; t0 < tokens; t0 += GDN_CHUNK) {
        const int present = min(GDN_CHUNK, tokens - t0);
        const bool more = t0 + GDN_CHUNK < tokens;
        cp_async_wait<1>(); // W, Q, U, G (K may still be in flight)
        __syncthreads();
        const double last = G[present - 1];

        // V' = U - W S (warps 0-7) or o = exp(G) (Q S) (warps 8-15) for tokens r0 .. r0 + 15.
        {
            const bool v_warp = warp < 8;
            const int r0 = 16 * (rows16 & 3);
            const float* a_tile = v_warp ? w_tile : q_tile;
            float acc[2][4] = {};
            warp_product_3xtf32<2>(
                acc, kd / 8, [&](int r, int k) { return a_tile[(r0 + r) * a_stride + k]; },
                [&](int k, int c) { return s[k * GDN_STATE_STRIDE + c_base + c]; }, tiles);
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int t = r0 + gdn_acc_row(r), c = c_base + 8 * n + gdn_acc_col(r);
                    if (n >= tiles) continue;
                    const size_t at = ((size_t)(t0 + t) * heads + h) * vd + col0 + c;
                    if (v_warp) {
                        const float vn = u_tile[t * GDN_STATE_STRIDE + c] - acc[n][r];
                        values[at] = vn;
                        v_new[t * GDN_STATE_STRIDE + c] = t < present ? expf((float)(last - G[t])) * vn : 0.0f;
                    } else if (t < present) {
                        o[at] = expf((float)G[t]) * acc[n][r];
                    }
                }
        }
        const float chunk_decay = expf((float)last);
        __syncthreads(); // W, Q, U and G are free; V' is whole
        if (more) load_wqug(t0 + GDN_CHUNK);
        cp_async_commit();
        cp_async_wait<1>(); // K
        __syncthreads();

        // S <- exp(G_last) S + K^T (exp(G_last - G) V') for the warp's rows and columns.
        if (owns_rows) {
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int r = 0; r < 4; ++r) st[n][r] *= chunk_decay;
            warp_product_3xtf32<2>(
                st, GDN_CHUNK / 8, [&](int r, int t) { return k_tile[t * k_stride + i0 + r]; },
                [&](int t, int c) { return v_new[t * GDN_STATE_STRIDE + c_base + c]; }, tiles);
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    if (n < tiles)
                        s[(i0 + gdn_acc_row(r)) * GDN_STATE_STRIDE + c_base + 8 * n + gdn_acc_col(r)] = st[n][r];
        }
        __syncthreads(); // K and V' are free
        if (more) load_k(t0 + GDN_CHUNK);
        cp_async_commit();
    }
    if (owns_rows)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int r = 0; r < 4; ++r)
                if (n < tiles) S[(size_t)(i0 + gdn_acc_row(r)) * vd + c_base + 8 * n + gdn_acc_col(r)] = st[n][r];
}

// Per (value head h, sub-chunk): adds the output's intra-sub-chunk term,
// o[t] += sum_{j <= t} exp(G_t - G_j) (q_t . k_j) V'[j], to what deltanet_chunk_state wrote.
// The masked Q K^T goes through shared memory; warp w computes its rows 16 (w / 2) .. + 16,
// columns 32 (w % 2) .. + 32, then 16 x 16 tiles of the output in turn. Q and K are copied to
// shared memory (cp.async), then V' over them once Q K^T is done.
// Grid: (value_heads, ceil(tokens / 64)), 256 threads (8 warps).
// Dynamic shared memory: (max(2 * 64 * (key_dim + 4), 64 * (value_dim + 8)) + 64 * GDN_A_STRIDE
// + 2 * 64) floats.
extern "C" __global__ void __launch_bounds__(256) deltanet_chunk_output(DeltaNetDims d, const float* act,
                                                                      const double* gcum, const float* values,
                                                                      int tokens, float* o) {
    extern __shared__ float smem[];
    const int kd = d.key_dim, vd = d.value_dim, heads = d.value_heads;
    const int h = blockIdx.x, t0 = blockIdx.y * GDN_CHUNK, present = min(GDN_CHUNK, tokens - t0);
    const int kh = h / (heads / d.key_heads);
    const int key_width = d.key_heads * kd, conv_dim = 2 * key_width + heads * vd;
    // Q and K are read as (row, k) fragments (rows 4 mod 32 banks apart), V' as (k, column) ones
    // (8 mod 32 apart).
    const int k_stride = kd + 4, v_stride = vd + 8;
    float* q_tile = smem;                          // [64, key_dim (+4)]
    float* k_tile = q_tile + GDN_CHUNK * k_stride; // [64, key_dim (+4)]
    float* v_tile = smem;                          // [64, value_dim (+8)]: V', once Q and K are done
    float* p_tile = smem + max(2 * GDN_CHUNK * k_stride, GDN_CHUNK * v_stride); // [64, 64 (+4)]: masked, decayed Q K^T
    double* G = reinterpret_cast<double*>(p_tile + GDN_CHUNK * GDN_A_STRIDE); // [64] (even offset)
    const int warp = threadIdx.x >> 5;
    wait_for_previous_kernel();

    const float* q_rows = act + (size_t)t0 * conv_dim + kh * kd;
    copy_sub_chunk(q_tile, k_stride, q_rows, conv_dim, kd, present);
    copy_sub_chunk(k_tile, k_stride, q_rows + key_width, conv_dim, kd, present);
    cp_async_commit();
    if (threadIdx.x < GDN_CHUNK)
        G[threadIdx.x] = threadIdx.x < present ? gcum[(size_t)(t0 + threadIdx.x) * heads + h] : 0.0;
    cp_async_wait<0>();
    __syncthreads();

    // (A missing token's G stands in as 0: it must not meet a present one's.)
    token_pair_products(q_tile, k_tile, k_stride, kd, p_tile, [&](int i, int j, float qk) {
        return j <= i && i < present ? expf((float)(G[i] - G[j])) * qk : 0.0f;
    });
    __syncthreads(); // Q and K are free

    // deltanet_chunk_state wrote whole sub-chunks of V'.
    copy_sub_chunk(v_tile, v_stride, values + ((size_t)t0 * heads + h) * vd, (size_t)heads * vd, vd, GDN_CHUNK);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    const int col_tiles = vd / 16;
    for (int tile = warp; tile < 4 * col_tiles; tile += 8) {
        const int r0 = 16 * (tile & 3), c0 = 16 * (tile >> 2);
        float acc[2][4] = {};
        warp_product_3xtf32<2>(
            acc, GDN_CHUNK / 8, [&](int r, int j) { return p_tile[(r0 + r) * GDN_A_STRIDE + j]; },
            [&](int j, int c) { return v_tile[j * v_stride + c0 + c]; });
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int t = r0 + gdn_acc_row(r), c = c0 + 8 * n + gdn_acc_col(r);
                if (t < present) o[((size_t)(t0 + t) * heads + h) * vd + c] += acc[n][r];
            }
    }
}

// out[t, h] = RMSNorm(o[t, h]) * norm_w * silu(z[t, h]) over each head's value_dim outputs. One
// warp per (token, value head), 8 per block. Grid: ceil(tokens * value_heads / 8), 256 threads.
extern "C" __global__ void __launch_bounds__(256) deltanet_gated_norm(DeltaNetDims d, const float* o, const float* proj,
                                                                    const float* norm_w, int tokens, float* out) {
    wait_for_previous_kernel();
    const int lane = threadIdx.x & 31, item = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (item >= tokens * d.value_heads) return;
    const int t = item / d.value_heads, h = item % d.value_heads;
    const int conv_dim = 2 * d.key_heads * d.key_dim + d.value_heads * d.value_dim;
    const size_t at = (size_t)t * d.value_heads * d.value_dim + (size_t)h * d.value_dim;
    const float* z = proj + (size_t)t * deltanet_proj_width(d, conv_dim) + conv_dim + h * d.value_dim;
    float ss = 0.0f;
    for (int i = lane; i < d.value_dim; i += 32) ss += o[at + i] * o[at + i];
    const float inv = rsqrtf(warp_sum(ss) / d.value_dim + d.eps);
    for (int i = lane; i < d.value_dim; i += 32) out[at + i] = o[at + i] * inv * norm_w[i] * silu(z[i]);
}

// Gated full attention, decode: q/k RMSNorm and partial RoPE with the KV-cache append, then
// attention split over the context (flash-decoding: each block covers a slice of positions for
// all query heads of one KV head, with an online softmax), then a combine that applies the
// output gate.


struct AttentionDims {
    int heads, kv_heads, head_dim, rotary_dim, max_context, splits;
    float eps;
    float rope_theta;
};

// Floats of one token's projection: [heads * 2 * head_dim (per head: query, gate) |
// kv_heads * head_dim (k) | kv_heads * head_dim (v)].
__device__ __forceinline__ int attention_proj_width(const AttentionDims& d) {
    return (2 * d.heads + 2 * d.kv_heads) * d.head_dim;
}

// Writes q (normed, rotated) and appends k, v at their positions to the bf16 caches [ctx, kv, hd]
// for tokens at positions position[0] + t, t = blockIdx.y (proj and q_out rows one per token).
// Launch: (heads + kv_heads, tokens) blocks of head_dim threads.
extern "C" __global__ void __launch_bounds__(256) attention_prepare(AttentionDims d, const float* proj, const float* q_norm,
                                             const float* k_norm, const int* position, float* q_out,
                                             bf16* k_cache, bf16* v_cache) {
    wait_for_previous_kernel();
    __shared__ float scratch[32];
    extern __shared__ float head[];
    const int b = blockIdx.x, i = threadIdx.x, hd = d.head_dim;
    // Token blockIdx.y of a run of tokens at consecutive positions.
    const int t = blockIdx.y;
    const int pos = position[0] + t;
    proj += (size_t)t * attention_proj_width(d);
    q_out += (size_t)t * d.heads * hd;
    const bool is_q = b < d.heads;
    const int kvh = b - d.heads;
    const float* src = is_q ? proj + (size_t)b * 2 * hd : proj + (size_t)d.heads * 2 * hd + (size_t)kvh * hd;
    const float x = src[i];
    const float ss = block_sum(x * x, scratch);
    head[i] = x * rsqrtf(ss / hd + d.eps) * (is_q ? q_norm[i] : k_norm[i]);
    __syncthreads();
    float y = head[i];
    const int half = d.rotary_dim / 2;
    if (i < d.rotary_dim) {
        const int f = i < half ? i : i - half;
        // Same as the reference: inverse frequency and angle formed in f32.
        const float inv_freq = 1.0f / powf(d.rope_theta, (float)(2 * f) / (float)d.rotary_dim);
        const float angle = (float)pos * inv_freq;
        float sn, cs;
        sincosf(angle, &sn, &cs);
        y = i < half ? head[i] * cs - head[i + half] * sn : head[i] * cs + head[i - half] * sn;
    }
    if (is_q) {
        q_out[(size_t)b * hd + i] = y;
    } else {
        const size_t at = ((size_t)pos * d.kv_heads + kvh) * hd + i;
        k_cache[at] = __float2bfloat16(y);
        const float* vsrc = proj + (size_t)d.heads * 2 * hd + (size_t)(d.kv_heads + kvh) * hd;
        v_cache[at] = __float2bfloat16(vsrc[i]);
    }
}

#define ATTN_CHUNK 32
#define ATTN_MAX_GROUP 16
#define ATTN_MAX_HEAD_DIM 256

// Positions per split for a context of `len` tokens: whole chunks, at most `max_splits` splits.
__device__ __forceinline__ int attention_split_len(int len, int max_splits) {
    const int per = (len + max_splits - 1) / max_splits;
    return max(ATTN_CHUNK, (per + ATTN_CHUNK - 1) / ATTN_CHUNK * ATTN_CHUNK);
}

// Block (kv head, split, token), 256 threads: the split's positions for all query heads of the KV head,
// ATTN_CHUNK positions at a time. Each chunk's keys (to registers) and values (to shared memory)
// are requested together up front, so a chunk costs one memory round trip. Scores: each warp
// takes every 8th position of the chunk, a lane 8 dimensions of its key (one 16-byte load).
// Values: thread t accumulates dimension t of every head. Writes per (head, split): running max,
// sum and unnormalised output. Splits beyond the context exit at once.
// Dynamic shared memory: ATTN_CHUNK * head_dim bf16 (the chunk's values).
template <int MAX_GROUP>
__device__ void attention_split_impl(const AttentionDims& d, const float* q, const bf16* k_cache, const bf16* v_cache,
                                     const int* position, float* part_max, float* part_sum, float* part_out) {
    wait_for_previous_kernel();
    __shared__ __align__(16) float qs[MAX_GROUP * ATTN_MAX_HEAD_DIM];
    __shared__ float scores[MAX_GROUP][ATTN_CHUNK];
    __shared__ float run_max[MAX_GROUP], run_sum[MAX_GROUP], correction[MAX_GROUP];
    extern __shared__ __align__(16) bf16 values[];  // [ATTN_CHUNK, head_dim]
    // Token blockIdx.z of a run of tokens at consecutive positions attends to positions
    // [0, position[0] + token].
    const int kvh = blockIdx.x, split = blockIdx.y, token = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int group = d.heads / d.kv_heads, hd = d.head_dim;
    const int len = position[0] + token + 1;
    q += (size_t)token * d.heads * hd;
    part_max += (size_t)token * d.heads * d.splits;
    part_sum += (size_t)token * d.heads * d.splits;
    part_out += (size_t)token * d.heads * d.splits * hd;
    const int per = attention_split_len(len, d.splits);
    const int begin = split * per;
    if (begin >= len) return;
    const int end = min(len, begin + per);
    const float scale = rsqrtf((float)hd);
    for (int i = threadIdx.x; i < group * hd; i += blockDim.x) qs[i] = q[(size_t)kvh * group * hd + i] * scale;
    if (threadIdx.x < group) {
        run_max[threadIdx.x] = -INFINITY;
        run_sum[threadIdx.x] = 0.0f;
    }
    float acc[MAX_GROUP];
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) acc[g] = 0.0f;
    const int key_lanes = hd / 8;
    const size_t row_stride = (size_t)d.kv_heads * hd;
    const bf16* k_base = k_cache + (size_t)kvh * hd;
    const bf16* v_base = v_cache + (size_t)kvh * hd;
    __syncthreads();

    for (int c0 = begin; c0 < end; c0 += ATTN_CHUNK) {
        const int n = min(ATTN_CHUNK, end - c0);
        constexpr int PER_WARP = ATTN_CHUNK / 8;
        constexpr int V_PER_THREAD = ATTN_CHUNK * (ATTN_MAX_HEAD_DIM / 8) / 256;
        uint4 keys[PER_WARP];
        uint4 vals[V_PER_THREAD];
#pragma unroll
        for (int t = 0; t < PER_WARP; ++t) {
            const int p = warp + warps * t;
            keys[t] = p < n && lane < key_lanes
                          ? __ldg(reinterpret_cast<const uint4*>(k_base + (size_t)(c0 + p) * row_stride) + lane)
                          : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < V_PER_THREAD; ++j) {
            const int i = threadIdx.x + 256 * j, p = i / key_lanes, col = i % key_lanes;
            vals[j] = p < n ? __ldg(reinterpret_cast<const uint4*>(v_base + (size_t)(c0 + p) * row_stride) + col)
                            : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int t = 0; t < PER_WARP; ++t) {
            const int p = warp + warps * t;
            if (p >= n) continue;
            const uint32_t w[4] = {keys[t].x, keys[t].y, keys[t].z, keys[t].w};
            float k[8];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                k[2 * e] = __uint_as_float(w[e] << 16);
                k[2 * e + 1] = __uint_as_float(w[e] & 0xffff0000u);
            }
            // All heads' partial dot products first, then their reductions: independent shuffles.
            float s[MAX_GROUP];
#pragma unroll
            for (int g = 0; g < MAX_GROUP; ++g) {
                s[g] = 0.0f;
                if (g < group && lane < key_lanes) {
                    const float4 a = *reinterpret_cast<const float4*>(qs + g * hd + lane * 8);
                    const float4 b = *reinterpret_cast<const float4*>(qs + g * hd + lane * 8 + 4);
                    s[g] = a.x * k[0] + a.y * k[1] + a.z * k[2] + a.w * k[3] + b.x * k[4] + b.y * k[5] + b.z * k[6] +
                           b.w * k[7];
                }
            }
#pragma unroll
            for (int g = 0; g < MAX_GROUP; ++g) {
                if (g >= group) break;
                const float v = warp_sum(s[g]);
                if (lane == 0) scores[g][p] = v;
            }
        }
#pragma unroll
        for (int j = 0; j < V_PER_THREAD; ++j) {
            const int i = threadIdx.x + 256 * j, p = i / key_lanes, col = i % key_lanes;
            if (p < ATTN_CHUNK) reinterpret_cast<uint4*>(values + (size_t)p * hd)[col] = vals[j];
        }
        __syncthreads();
        // Online softmax: warp w updates heads w, w + 8, ...
        for (int g = warp; g < group; g += warps) {
            static_assert(ATTN_CHUNK == 32, "the softmax gives each lane one position of the chunk");
            const float s0 = lane < n ? scores[g][lane] : -INFINITY;
            const float m_new = fmaxf(run_max[g], warp_max(s0));
            const float e0 = lane < n ? __expf(s0 - m_new) : 0.0f;
            scores[g][lane] = e0;
            const float sum = warp_sum(e0);
            if (lane == 0) {
                const float c = __expf(run_max[g] - m_new);
                correction[g] = c;
                run_sum[g] = run_sum[g] * c + sum;
                run_max[g] = m_new;
            }
        }
        __syncthreads();
        if (threadIdx.x < hd) {
#pragma unroll
            for (int g = 0; g < MAX_GROUP; ++g)
                if (g < group) acc[g] *= correction[g];
#pragma unroll 8
            for (int p = 0; p < n; ++p) {
                const float v = __bfloat162float(values[(size_t)p * hd + threadIdx.x]);
#pragma unroll
                for (int g = 0; g < MAX_GROUP; ++g)
                    if (g < group) acc[g] += scores[g][p] * v;
            }
        }
        __syncthreads();
    }
    const int head0 = kvh * group;
    if (threadIdx.x < group) {
        const size_t slot = (size_t)(head0 + threadIdx.x) * d.splits + split;
        part_max[slot] = run_max[threadIdx.x];
        part_sum[slot] = run_sum[threadIdx.x];
    }
    if (threadIdx.x < hd) {
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g)
            if (g < group) part_out[((size_t)(head0 + g) * d.splits + split) * hd + threadIdx.x] = acc[g];
    }
}

extern "C" __global__ void __launch_bounds__(256) attention_split(AttentionDims d, const float* q, const bf16* k_cache,
                                                                 const bf16* v_cache, const int* position,
                                                                 float* part_max, float* part_sum, float* part_out) {
    if (d.heads / d.kv_heads <= 8) attention_split_impl<8>(d, q, k_cache, v_cache, position, part_max, part_sum, part_out);
    else attention_split_impl<ATTN_MAX_GROUP>(d, q, k_cache, v_cache, position, part_max, part_sum, part_out);
}

// Merges the splits of each head and applies the output gate sigmoid(gate), for token
// t = blockIdx.y at position position[0] + t. Launch: (heads, tokens) blocks of head_dim threads;
// splits (at most 1024) are shared out over them.
extern "C" __global__ void __launch_bounds__(256) attention_combine(AttentionDims d, const float* proj,
                                                                   const int* position, const float* part_max,
                                                                   const float* part_sum, const float* part_out,
                                                                   float* out) {
    wait_for_previous_kernel();
    __shared__ float scratch[32];
    __shared__ float split_weight[1024];
    const int head = blockIdx.x, i = threadIdx.x, hd = d.head_dim, t = blockIdx.y;
    const int len = position[0] + t + 1;
    const int per = attention_split_len(len, d.splits);
    const int splits = (len + per - 1) / per;
    proj += (size_t)t * attention_proj_width(d);
    out += (size_t)t * d.heads * hd;
    part_max += (size_t)t * d.heads * d.splits;
    part_sum += (size_t)t * d.heads * d.splits;
    part_out += (size_t)t * d.heads * d.splits * hd;
    const float* pm = part_max + (size_t)head * d.splits;
    const float* ps = part_sum + (size_t)head * d.splits;
    float m = -INFINITY;
    for (int s = i; s < splits; s += blockDim.x) m = fmaxf(m, pm[s]);
    m = warp_max(m);
    __syncthreads();
    if ((i & 31) == 0) scratch[i >> 5] = m;
    __syncthreads();
    m = -INFINITY;
    for (int w = 0; w < (int)((blockDim.x + 31) >> 5); ++w) m = fmaxf(m, scratch[w]);
    float l = 0.0f;
    for (int s = i; s < splits; s += blockDim.x) {
        const float w = __expf(pm[s] - m);
        split_weight[s] = w;
        l += w * ps[s];
    }
    l = block_sum(l, scratch);
    float acc = 0.0f;
    const float* po = part_out + (size_t)head * d.splits * hd + i;
#pragma unroll 8
    for (int s = 0; s < splits; ++s) acc += split_weight[s] * po[(size_t)s * hd];
    const float gate = proj[(size_t)head * 2 * hd + hd + i];
    out[(size_t)head * hd + i] = acc / l * sigmoid(gate);
}

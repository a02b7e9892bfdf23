// Gated full attention, decode: q/k RMSNorm and partial RoPE with the KV-cache append, then
// attention split over the context (flash-decoding: each block covers a slice of positions for
// all query heads of one KV head, with an online softmax), then a combine that applies the
// output gate.

#define MAX_DIMS_PER_LANE 8

struct AttentionDims {
    int heads, kv_heads, head_dim, rotary_dim, max_context, splits;
    float eps;
    float rope_theta;
};

// proj: [heads * 2 * head_dim (per head: query, gate) | kv_heads * head_dim (k) | kv (v)].
// Writes q (normed, rotated) and appends k, v at `position` to the bf16 caches [ctx, kv, hd].
// Launch: heads + kv_heads blocks of head_dim threads.
extern "C" __global__ void __launch_bounds__(256) attention_prepare(AttentionDims d, const float* proj, const float* q_norm,
                                             const float* k_norm, const int* position, float* q_out,
                                             bf16* k_cache, bf16* v_cache) {
    __shared__ float scratch[32];
    extern __shared__ float head[];
    const int b = blockIdx.x, i = threadIdx.x, hd = d.head_dim;
    const int pos = position[0];
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

// Block (kv head, split): warp w handles query head kv_head * group + w over the split's slice
// of positions 0..=position. Writes per (head, split): running max, sum and unnormalised output.
extern "C" __global__ void __launch_bounds__(512) attention_split(AttentionDims d, const float* q, const bf16* k_cache,
                                           const bf16* v_cache, const int* position, float* part_max,
                                           float* part_sum, float* part_out) {
    const int kvh = blockIdx.x, split = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = d.heads / d.kv_heads;
    const int head = kvh * group + warp;
    const int hd = d.head_dim;
    const int len = position[0] + 1;
    const int per = (len + d.splits - 1) / d.splits;
    const int begin = split * per, end = min(len, begin + per);
    const float scale = rsqrtf((float)hd);

    float qv[MAX_DIMS_PER_LANE], acc[MAX_DIMS_PER_LANE];
#pragma unroll
    for (int e = 0; e < MAX_DIMS_PER_LANE; ++e) {
        const int dd = lane + 32 * e;
        qv[e] = dd < hd ? q[(size_t)head * hd + dd] * scale : 0.0f;
        acc[e] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int p = begin; p < end; ++p) {
        const bf16* kp = k_cache + ((size_t)p * d.kv_heads + kvh) * hd;
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < MAX_DIMS_PER_LANE; ++e) {
            const int dd = lane + 32 * e;
            if (dd < hd) s += qv[e] * __bfloat162float(kp[dd]);
        }
        s = warp_sum(s);
        const float m_new = fmaxf(m, s);
        const float correction = __expf(m - m_new);
        const float w = __expf(s - m_new);
        l = l * correction + w;
        const bf16* vp = v_cache + ((size_t)p * d.kv_heads + kvh) * hd;
#pragma unroll
        for (int e = 0; e < MAX_DIMS_PER_LANE; ++e) {
            const int dd = lane + 32 * e;
            if (dd < hd) acc[e] = acc[e] * correction + w * __bfloat162float(vp[dd]);
        }
        m = m_new;
    }
    const size_t slot = (size_t)head * d.splits + split;
    if (lane == 0) {
        part_max[slot] = m;
        part_sum[slot] = l;
    }
#pragma unroll
    for (int e = 0; e < MAX_DIMS_PER_LANE; ++e) {
        const int dd = lane + 32 * e;
        if (dd < hd) part_out[slot * hd + dd] = acc[e];
    }
}

// Merges the splits of each head and applies the output gate sigmoid(gate).
// Launch: heads blocks of head_dim threads.
extern "C" __global__ void __launch_bounds__(256) attention_combine(AttentionDims d, const float* proj, const float* part_max,
                                             const float* part_sum, const float* part_out, float* out) {
    const int head = blockIdx.x, i = threadIdx.x, hd = d.head_dim;
    float m = -INFINITY;
    for (int s = 0; s < d.splits; ++s) m = fmaxf(m, part_max[(size_t)head * d.splits + s]);
    float l = 0.0f, acc = 0.0f;
    for (int s = 0; s < d.splits; ++s) {
        const size_t slot = (size_t)head * d.splits + s;
        const float ms = part_max[slot];
        if (ms == -INFINITY) continue;
        const float w = __expf(ms - m);
        l += w * part_sum[slot];
        acc += w * part_out[slot * hd + i];
    }
    const float gate = proj[(size_t)head * 2 * hd + hd + i];
    out[(size_t)head * hd + i] = acc / l * sigmoid(gate);
}

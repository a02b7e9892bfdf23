// One fused Gated DeltaNet decode step per value head: causal conv (ring-buffered history),
// SiLU, L2 norms, gates, the fp32 recurrent delta-rule update and the gated RMSNorm.
//
// The conv history is a ring of `kernel` slots indexed by position: this step writes slot
// pos % kernel and reads the other kernel - 1 slots, so blocks sharing a key head never race.

#define MAX_ROWS_PER_THREAD 32

struct DeltaNetDims {
    int key_heads, value_heads, key_dim, value_dim, kernel;
    float eps;
};

// proj: [conv_dim (q|k|v) | z (value_heads*value_dim) | b (value_heads) | a (value_heads)].
// conv_ring: [kernel, conv_dim]; conv_w: [conv_dim, kernel]; state: [value_heads, key_dim, value_dim].
// Launch: one block per value head, value_dim * groups threads, groups = max(1, key_dim / 32).
extern "C" __global__ void __launch_bounds__(512) deltanet_step(DeltaNetDims d, const float* proj, float* conv_ring, const float* conv_w,
                                         const float* a_log, const float* dt_bias, const float* norm_w,
                                         float* state, const int* position, float* out) {
    extern __shared__ float smem[];
    const int h = blockIdx.x;
    const int ratio = d.value_heads / d.key_heads;
    const int kh = h / ratio;
    const int key_width = d.key_heads * d.key_dim;
    const int conv_dim = 2 * key_width + d.value_heads * d.value_dim;
    const int pos = position[0];
    const int slot = pos % d.kernel;

    // The recurrent state does not depend on this step's inputs: its loads go out first.
    // Thread (dv, grp) owns state rows grp, grp + groups, ... of column dv.
    const int groups = blockDim.x / d.value_dim;
    const int dv = threadIdx.x % d.value_dim;
    const int grp = threadIdx.x / d.value_dim;
    const int rows = d.key_dim / groups;
    float* S = state + (size_t)h * d.key_dim * d.value_dim;
    float s[MAX_ROWS_PER_THREAD];
#pragma unroll
    for (int i = 0; i < MAX_ROWS_PER_THREAD; ++i)
        if (i < rows) s[i] = S[(grp + i * groups) * d.value_dim + dv];
    // The state was last written by this layer's step of the previous token, long finished.
    wait_for_previous_kernel();

    float* q = smem;                 // [key_dim]
    float* k = q + d.key_dim;        // [key_dim]
    float* v = k + d.key_dim;        // [value_dim]
    float* red = v + d.value_dim;    // [groups, value_dim]
    float* scratch = red + blockDim.x;  // [32]

    // Causal conv + SiLU over the channels this head reads: its key head's q and k, its v.
    const int nq = d.key_dim, nv = d.value_dim;
    for (int i = threadIdx.x; i < 2 * nq + nv; i += blockDim.x) {
        int ch;
        float* dst;
        if (i < nq) { ch = kh * d.key_dim + i; dst = q + i; }
        else if (i < 2 * nq) { ch = key_width + kh * d.key_dim + (i - nq); dst = k + (i - nq); }
        else { ch = 2 * key_width + h * d.value_dim + (i - 2 * nq); dst = v + (i - 2 * nq); }
        const float cur = proj[ch];
        float acc = conv_w[ch * d.kernel + d.kernel - 1] * cur;
        for (int j = 1; j < d.kernel; ++j) {
            // Tap kernel-1-j reads the input j steps back.
            const int s = (pos - j + d.kernel * 4) % d.kernel;
            const float past = pos - j >= 0 ? conv_ring[s * conv_dim + ch] : 0.0f;
            acc += conv_w[ch * d.kernel + d.kernel - 1 - j] * past;
        }
        *dst = silu(acc);
        // q/k channels are shared by `ratio` value heads: the first of them records the input.
        const bool owner = i >= 2 * nq || h % ratio == 0;
        if (owner) conv_ring[slot * conv_dim + ch] = cur;
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

    const float* zba = proj + conv_dim;
    const float b = zba[d.value_heads * d.value_dim + h];
    const float a = zba[d.value_heads * d.value_dim + d.value_heads + h];
    const float beta = sigmoid(b);
    const float decay = __expf(-__expf(a_log[h]) * softplus(a + dt_bias[h]));

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
    for (int g = 0; g < groups; ++g) kv += red[g * d.value_dim + dv];
    const float delta = beta * (v[dv] - kv);
    float o = 0.0f;
#pragma unroll
    for (int i = 0; i < MAX_ROWS_PER_THREAD; ++i) {
        if (i < rows) {
            const int dk = grp + i * groups;
            s[i] += k[dk] * delta;
            S[dk * d.value_dim + dv] = s[i];
            o += s[i] * q[dk];
        }
    }
    __syncthreads();
    red[threadIdx.x] = o;
    __syncthreads();
    o = 0.0f;
    for (int g = 0; g < groups; ++g) o += red[g * d.value_dim + dv];

    // Gated RMSNorm over the head: norm(o) * w * silu(z).
    const float sq = block_sum(grp == 0 ? o * o : 0.0f, scratch);
    if (grp == 0) {
        const float inv = rsqrtf(sq / d.value_dim + d.eps);
        const float z = zba[h * d.value_dim + dv];
        out[h * d.value_dim + dv] = o * inv * norm_w[dv] * silu(z);
    }
}

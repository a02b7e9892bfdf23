// Weight-row dot products shared by every kernel that multiplies by a weight matrix: x is staged
// in shared memory (optionally RMS-normalised first, so the norm needs no kernel of its own), then
// a warp computes a whole row with 16-byte weight loads. x is stored chunk-transposed (value j of
// chunk c at xs[j * chunks + c]) so the 32 lanes, which work on 32 consecutive chunks, read
// consecutive shared-memory words: no bank conflicts.

// Stages x (normalised by `norm_scale` when non-null) and, for quantised weights, the sum of x
// over each quantisation group (the bias term of a group is bias * sum(x)).
__device__ void stage_input(const Weight& w, const float* x, const float* norm_scale, float eps,
                            float* xs, float* gsum, float* scratch) {
    const int cols = w.cols;
    const int vpc = values_per_chunk(w.bits);
    const int chunks = cols / vpc;
    float inv = 1.0f;
    if (norm_scale != nullptr) {
        float ss = 0.0f;
        for (int i = threadIdx.x; i < cols; i += blockDim.x) ss += x[i] * x[i];
        ss = block_sum(ss, scratch);
        inv = rsqrtf(ss / cols + eps);
    }
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = x[i] * inv;
        if (norm_scale != nullptr) v *= norm_scale[i];
        xs[(i % vpc) * chunks + i / vpc] = v;
    }
    __syncthreads();
    if (w.bits != 16) {
        const int groups = cols / w.group;
        for (int g = threadIdx.x; g < groups; g += blockDim.x) {
            float s = 0.0f;
            for (int i = g * w.group; i < (g + 1) * w.group; ++i) s += xs[(i % vpc) * chunks + i / vpc];
            gsum[g] = s;
        }
        __syncthreads();
    }
}

// One row's dot product with the staged x, computed by a whole warp; every lane gets the sum.
__device__ float row_dot(const Weight& w, int row, const float* xs, const float* gsum, int lane) {
    const int cols = w.cols;
    float acc = 0.0f;
    if (w.bits == 16) {
        const int chunks = cols / 8;
        const uint4* p = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(w.data) + (size_t)row * cols);
        for (int c = lane; c < chunks; c += 32) {
            uint4 u = __ldg(p + c);
            uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                acc += __uint_as_float(words[k] << 16) * xs[(2 * k) * chunks + c];
                acc += __uint_as_float(words[k] & 0xffff0000u) * xs[(2 * k + 1) * chunks + c];
            }
        }
    } else {
        const int vpc = values_per_chunk(w.bits);
        const int chunks = cols / vpc;
        const int groups = cols / w.group;
        const uint4* p = reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(w.data) +
                                                        (size_t)row * cols * w.bits / 32);
        const bf16* scales = w.scales + (size_t)row * groups;
        const bf16* biases = w.biases + (size_t)row * groups;
        for (int c = lane; c < chunks; c += 32) {
            uint4 u = __ldg(p + c);
            uint32_t words[4] = {u.x, u.y, u.z, u.w};
            float s = 0.0f;
            if (w.bits == 4) {
#pragma unroll
                for (int k = 0; k < 4; ++k)
#pragma unroll
                    for (int j = 0; j < 8; ++j)
                        s += (float)((words[k] >> (4 * j)) & 15u) * xs[(8 * k + j) * chunks + c];
            } else {
#pragma unroll
                for (int k = 0; k < 4; ++k)
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        s += (float)((words[k] >> (8 * j)) & 255u) * xs[(4 * k + j) * chunks + c];
            }
            acc += __bfloat162float(scales[(c * vpc) / w.group]) * s;
        }
        for (int g = lane; g < groups; g += 32) acc += __bfloat162float(biases[g]) * gsum[g];
    }
    return warp_sum(acc);
}


// Decode mat-vec products y = W x for one token, for every weight format (bf16, MLX 4/8-bit),
// and the embedding lookup. The row arithmetic lives in rowdot.cuh.

#define MATVEC_ROWS_PER_WARP 4

template <int BITS>
__device__ void matvec_rows(const Weight& w, const float* xs, float* y, int accumulate) {
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int chunks = w.cols / values_per_chunk(BITS);
    for (int row0 = (blockIdx.x * warps + (threadIdx.x >> 5)) * MATVEC_ROWS_PER_WARP; row0 < w.rows;
         row0 += gridDim.x * warps * MATVEC_ROWS_PER_WARP) {
        RowRef rows[MATVEC_ROWS_PER_WARP];
        float acc[MATVEC_ROWS_PER_WARP];
#pragma unroll
        for (int i = 0; i < MATVEC_ROWS_PER_WARP; ++i) {
            rows[i] = row_ref(w, row0 + i, xs);
            acc[i] = 0.0f;
        }
        dot_rows<BITS, MATVEC_ROWS_PER_WARP, 2>(rows, chunks, w.group, lane, acc);
#pragma unroll
        for (int i = 0; i < MATVEC_ROWS_PER_WARP; ++i) {
            const float v = warp_sum(acc[i]);
            const int row = row0 + i;
            if (lane == 0 && row < w.rows) y[row] = accumulate ? y[row] + v : v;
        }
    }
}

// y[r] = (W x)[r], or y[r] += (W x)[r] when `accumulate` (residual adds). `norm_scale` non-null:
// x is RMS-normalised and scaled first. Shared memory: 32 + staged_floats(cols) floats.
extern "C" __global__ void __launch_bounds__(256) matvec(Weight w, const float* x, const float* norm_scale, float eps,
                                                         float* y, int accumulate) {
    extern __shared__ __align__(16) float smem[];
    float* xs = smem + 32;
    stage_input(w.bits, w.cols, x, norm_scale, eps, xs, smem);
    switch (w.bits) {
        case 4: matvec_rows<4>(w, xs, y, accumulate); break;
        case 8: matvec_rows<8>(w, xs, y, accumulate); break;
        default: matvec_rows<16>(w, xs, y, accumulate); break;
    }
}

// x = row `token[0]` of the embedding table, dequantised to f32.
extern "C" __global__ void __launch_bounds__(256) embed(Weight w, const int* token, float* x) {
    const int row = token[0];
    const int cols = w.cols;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < cols; i += gridDim.x * blockDim.x) {
        float v;
        if (w.bits == 16) {
            v = bf16_to_f32(static_cast<const uint16_t*>(w.data)[(size_t)row * cols + i]);
        } else {
            const int per_word = 32 / w.bits;
            const uint32_t word = static_cast<const uint32_t*>(w.data)[((size_t)row * cols + i) / per_word];
            const uint32_t q = (word >> (w.bits * (i % per_word))) & ((1u << w.bits) - 1u);
            const size_t g = (size_t)row * (cols / w.group) + i / w.group;
            v = __bfloat162float(w.scales[g]) * (float)q + __bfloat162float(w.biases[g]);
        }
        x[i] = v;
    }
}

// Decode mat-vec products y = W x for one token, for every weight format (bf16, MLX 4/8-bit),
// and the embedding lookup. The row arithmetic lives in rowdot.cuh.

// Each warp computes R rows at a time, U 16-byte chunks of each per lane per pass: R = 4, U = 2
// for tall matrices; R = 1, U = 4 for short ones, which then spread over more blocks.
template <int BITS, int R, int U>
__device__ void matvec_impl(const Weight& w, const float* x, const float* norm_scale, float eps, float* y,
                            int accumulate, float* smem) {
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int chunks = w.cols / values_per_chunk(BITS);
    const int stride = gridDim.x * warps * R;
    float* xs = smem + 32;
    int row0 = (blockIdx.x * warps + (threadIdx.x >> 5)) * R;
    RowRef rows[R];
    Pass<R, U> pass;
#pragma unroll
    for (int i = 0; i < R; ++i) rows[i] = row_ref(w, row0 + i, xs);
    // The first rows' weights are in flight while the input is staged.
    load_pass<BITS, R, U>(rows, 0, w.group, lane, pass);
    wait_for_previous_kernel();
    stage_input(BITS, w.cols, x, norm_scale, eps, xs, smem);
    while (row0 < w.rows) {
        float acc[R];
#pragma unroll
        for (int i = 0; i < R; ++i) acc[i] = 0.0f;
        dot_rows<BITS, R, U, true>(rows, chunks, w.group, lane, pass, acc);
        const int next = row0 + stride;
        RowRef next_rows[R];
#pragma unroll
        for (int i = 0; i < R; ++i) next_rows[i] = row_ref(w, next + i, xs);
        if (next < w.rows) load_pass<BITS, R, U>(next_rows, 0, w.group, lane, pass);
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const float v = warp_sum(acc[i]);
            const int row = row0 + i;
            if (lane == 0 && row < w.rows) y[row] = accumulate ? y[row] + v : v;
            rows[i] = next_rows[i];
        }
        row0 = next;
    }
}

template <int R, int U>
__device__ void matvec_bits(const Weight& w, const float* x, const float* norm_scale, float eps, float* y,
                            int accumulate, float* smem) {
    switch (w.bits) {
        case 4: matvec_impl<4, R, U>(w, x, norm_scale, eps, y, accumulate, smem); break;
        case 8: matvec_impl<8, R, U>(w, x, norm_scale, eps, y, accumulate, smem); break;
        default: matvec_impl<16, R, U>(w, x, norm_scale, eps, y, accumulate, smem); break;
    }
}

// y[r] = (W x)[r], or y[r] += (W x)[r] when `accumulate` (residual adds). `norm_scale` non-null:
// x is RMS-normalised and scaled first. `rows_per_warp`: 4 or 1 (see matvec_impl).
// Shared memory: 32 + staged_floats(cols) floats.
extern "C" __global__ void __launch_bounds__(256, 2) matvec(Weight w, const float* x, const float* norm_scale, float eps,
                                                         float* y, int accumulate, int rows_per_warp) {
    extern __shared__ __align__(16) float smem[];
    if (rows_per_warp == 4) matvec_bits<4, 2>(w, x, norm_scale, eps, y, accumulate, smem);
    else matvec_bits<1, 4>(w, x, norm_scale, eps, y, accumulate, smem);
}

// x = row `token[0]` of the embedding table, dequantised to f32.
extern "C" __global__ void __launch_bounds__(256) embed(Weight w, const int* token, float* x) {
    wait_for_previous_kernel();
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

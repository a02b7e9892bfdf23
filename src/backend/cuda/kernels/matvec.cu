// Decode mat-vec products y = W x for one token, for every weight format (bf16, MLX 4/8-bit),
// and the embedding lookup. The row arithmetic (and matvec_impl) lives in rowdot.cuh.

// y[r] = (W x)[r], or y[r] += (W x)[r] when `accumulate` (residual adds; y is then read before
// waiting for the previous kernel, which must not have written it). `norm_scale` non-null:
// x is RMS-normalised and scaled first. Several tokens at once: blockIdx.y is the token, whose x
// and y rows follow each other (w.cols and w.rows floats apart).
// A warp dots one row at a time, four 16-byte chunks per lane per pass (rows of up to 128 chunks
// in one pass). Shared memory: 64 + staged_floats(cols) floats.
extern "C" __global__ void __launch_bounds__(256, 3) matvec(Weight w, const float* x, const float* norm_scale, float eps,
                                                         float* y, int accumulate) {
    TRACE_BLOCK();
    extern __shared__ __align__(16) float smem[];
    const size_t t = blockIdx.y;
    matvec_bits<1, 4>(w, x + t * w.cols, norm_scale, eps, y + t * w.rows, accumulate, smem);
}

// `matvec` for rows of at most 64 chunks (2,048 4-bit inputs: the hidden size): a warp dots two
// rows at a time, two chunks of each per lane, so the lanes that would idle on a short row's
// missing chunks fetch a second row instead (twice the bytes in flight per warp).
extern "C" __global__ void __launch_bounds__(256, 3) matvec_two_rows(Weight w, const float* x, const float* norm_scale,
                                                                  float eps, float* y, int accumulate) {
    TRACE_BLOCK();
    extern __shared__ __align__(16) float smem[];
    const size_t t = blockIdx.y;
    matvec_bits<2, 2>(w, x + t * w.cols, norm_scale, eps, y + t * w.rows, accumulate, smem);
}

// x[t] = row `token[t]` of the embedding table, dequantised to f32; blockIdx.y is t. Batched
// (token_of non-null): row t is the token of sequence t of the table.
extern "C" __global__ void __launch_bounds__(256) embed(Weight w, const int* token, float* x,
                                                      const unsigned long long* token_of) {
    TRACE_BLOCK();
    wait_for_previous_kernel();
    const int row = *seq_buffer(token + blockIdx.y, token_of, blockIdx.y);
    const int cols = w.cols;
    x += (size_t)blockIdx.y * cols;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < cols; i += gridDim.x * blockDim.x) {
        float v;
        if (w.bits == 16) {
            v = bf16_to_f32(static_cast<const uint16_t*>(w.data)[(size_t)row * cols + i]);
        } else {
            const int per_word = 32 / w.bits;
            const uint32_t word = static_cast<const uint32_t*>(w.data)[((size_t)row * cols + i) / per_word];
            const uint32_t q = (word >> (w.bits * (i % per_word))) & ((1u << w.bits) - 1u);
            const size_t g = (size_t)row * (cols >> w.group_shift) + (i >> w.group_shift);
            v = __bfloat162float(w.scales[g]) * (float)q + __bfloat162float(w.biases[g]);
        }
        x[i] = v;
    }
}

// Decode mat-vec products y = W x for one token, for every weight format (bf16, MLX 4/8-bit),
// the embedding lookup, and the tensor-core product of a batched decode step's tokens
// (matvec_mma, at the end). The row arithmetic (and matvec_impl) lives in rowdot.cuh.

// y[r] = (W x)[r], or y[r] = add[r] + (W x)[r] when `add` is non-null (residual adds, in place
// when add is y; add is then read before waiting for the previous kernel, which must not have
// written it). `norm_scale` non-null: x is RMS-normalised and scaled first. Several tokens at
// once: blockIdx.y is the token, whose x and y (and add) rows follow each other (w.cols and
// w.rows floats apart).
// A warp dots one row at a time, four 16-byte chunks per lane per pass (rows of up to 128 chunks
// in one pass). Shared memory: 64 + staged_floats(cols) floats. At most 72 registers: the 8-bit
// path would take 75, which the allocation rounds up to 80 for every format, leaving less room on
// an SM beside its three blocks (the 4-bit path needs under 72).
extern "C" __global__ void __maxnreg__(72) matvec(Weight w, const float* x, const float* norm_scale, float eps,
                                                         float* y, const float* add) {
    TRACE_BLOCK();
    extern __shared__ __align__(16) float smem[];
    const size_t t = blockIdx.y;
    matvec_bits<1, 4>(w, x + t * w.cols, norm_scale, eps, y + t * w.rows, add != nullptr ? add + t * w.rows : nullptr,
                      smem, blockIdx.x, gridDim.x);
}

// `matvec` for rows of at most 64 chunks (2,048 4-bit inputs: the hidden size): a warp dots two
// rows at a time, two chunks of each per lane, so the lanes that would idle on a short row's
// missing chunks fetch a second row instead (twice the bytes in flight per warp).
extern "C" __global__ void __launch_bounds__(256, 3) matvec_two_rows(Weight w, const float* x, const float* norm_scale,
                                                                  float eps, float* y, const float* add) {
    TRACE_BLOCK();
    extern __shared__ __align__(16) float smem[];
    const size_t t = blockIdx.y;
    matvec_bits<2, 2>(w, x + t * w.cols, norm_scale, eps, y + t * w.rows, add != nullptr ? add + t * w.rows : nullptr,
                      smem, blockIdx.x, gridDim.x);
}

// A few tokens per block (a batched decode step of up to MATVEC_TOKENS sequences): each weight
// row is read once for all of them (matvec_tokens_impl). Block row blockIdx.y takes tokens
// per_block * blockIdx.y .. + per_block - 1 (per_block <= MATVEC_TOKENS). Shared memory:
// MATVEC_TOKENS * 2 floats per warp, then per_block * (64 + staged_floats(cols)).
#define MATVEC_TOKENS 4
#ifndef MATVEC_TOKENS_BLOCKS
#define MATVEC_TOKENS_BLOCKS 3  // blocks per SM the launch bounds ask for
#endif
extern "C" __global__ void __launch_bounds__(256, MATVEC_TOKENS_BLOCKS) matvec_tokens(Weight w, const float* x, const float* norm_scale,
                                                                float eps, float* y, const float* add, int tokens,
                                                                int per_block) {
    TRACE_BLOCK();
    extern __shared__ __align__(16) float smem[];
    const int first = blockIdx.y * per_block;
    matvec_tokens_bits<1, 4, MATVEC_TOKENS>(w, x + (size_t)first * w.cols, norm_scale, eps,
                                            y + (size_t)first * w.rows, add != nullptr ? add + (size_t)first * w.rows : nullptr,
                                            min(per_block, tokens - first), smem);
}

// `matvec_tokens` for rows of at most 64 chunks, two rows per warp pass (as matvec_two_rows).
extern "C" __global__ void __launch_bounds__(256, MATVEC_TOKENS_BLOCKS) matvec_two_rows_tokens(Weight w, const float* x,
                                                                         const float* norm_scale, float eps, float* y,
                                                                         const float* add, int tokens, int per_block) {
    TRACE_BLOCK();
    extern __shared__ __align__(16) float smem[];
    const int first = blockIdx.y * per_block;
    matvec_tokens_bits<2, 2, MATVEC_TOKENS>(w, x + (size_t)first * w.cols, norm_scale, eps,
                                            y + (size_t)first * w.rows, add != nullptr ? add + (size_t)first * w.rows : nullptr,
                                            min(per_block, tokens - first), smem);
}

// x[t] = row `token[t]` of the embedding table, dequantised to f32; blockIdx.y is t. Batched
// (token_of non-null): row t is the token of sequence t of the table. With batch_context, also
// the sum of the step's context lengths (each row's sequence's position + 1, from position_of),
// for attention's shared splits (see AttentionSeqs in attention.cu).
extern "C" __global__ void __launch_bounds__(256) embed(Weight w, const int* token, float* x,
                                                      const unsigned long long* token_of,
                                                      const unsigned long long* position_of, int* batch_context) {
    TRACE_BLOCK();
    wait_for_previous_kernel();
    if (batch_context != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x < 32) {
        int total = 0;
        for (int r = threadIdx.x; r < gridDim.y; r += 32) total += row_position(nullptr, position_of, r) + 1;
        for (int mask = 16; mask > 0; mask >>= 1) total += __shfl_xor_sync(0xffffffffu, total, mask);
        if (threadIdx.x == 0) *batch_context = total;
    }
    const int row = *seq_buffer(token + blockIdx.y, token_of, blockIdx.y);
    const int cols = w.cols;
    x += (size_t)blockIdx.y * cols;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < cols; i += gridDim.x * blockDim.x)
        x[i] = weight_value(w, row, i);
}

// ---------------------------------------------------------------------------------------------
// Batched decode products on tensor cores: y[t] = W x[t] for the tokens of a batched step, each
// weight row read once for MMA_TOKENS of them. The integer dot of `matvec` reads its staged
// input from shared memory once per row and token, which at eight tokens is more shared-memory
// traffic than the SM has; an mma.m16n8k16 takes a 16 x 16 tile of weights (dequantised to fp16
// in registers) against 16 inputs of 8 tokens at once.
//
// A warp owns 16 rows (lane (g, c), g = lane / 4, c = lane % 4, holds rows g and g + 8) and walks
// them 4 lanes x 16 bytes = 128 (4-bit) or 64 (8-bit) inputs at a time. A dot product does not
// care in which order it visits k, so each lane feeds the mma the k values its own 16 bytes hold
// (the A fragment's columns 2c, 2c + 1, 2c + 8, 2c + 9 of each step), and the inputs are staged
// in the matching order: 4-bit: in a word of 8 nibbles, pairs (n0, n4), (n1, n5) make one step and
// (n2, n6), (n3, n7) the next, so each group of 8 inputs is stored as (0, 4, 1, 5, 2, 6, 3, 7);
// 8-bit: bytes (b0, b2), (b1, b3) of a word make a step, groups of 4 stored as (0, 2, 1, 3). A
// lane's B fragment for a step is then 4 consecutive fp16 values: one 8-byte shared load.
//
// The inputs are held in fp16 after division by a per-token power of two (|x / s| < 2^14), the
// RMS norm applied before; products accumulate in f32.

#define MMA_TOKENS 8   // tokens per block (the mma's n)
#define MMA_PASS 4     // 16-byte loads per row and lane in flight per pass

__device__ __forceinline__ void mma_f16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (scale * q + bias) for the two values at bits [shift, shift + BITS) and [shift + 16, ...) of w,
// as an fp16 pair.
template <int BITS>
__device__ __forceinline__ uint32_t mma_dequant(uint32_t w, int shift, __half2 scale, __half2 bias) {
    const uint32_t mask = BITS == 4 ? 0x000F000Fu : 0x00FF00FFu;
    const __half2 q = __hsub2(as_half2(mask_or(w >> shift, mask, 0x64006400u)), __float2half2_rn(1024.0f));
    const __half2 v = __hfma2(q, scale, bias);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// One pass of a warp's rows g and g + 8: MMA_PASS 16-byte chunks of each from `chunk` (4 lanes
// of a quad side by side), with their groups' scales and biases as fp16 pairs.
struct MmaPass {
    uint4 lo[MMA_PASS], hi[MMA_PASS];
    __half2 scale_lo[MMA_PASS], bias_lo[MMA_PASS], scale_hi[MMA_PASS], bias_hi[MMA_PASS];
};

template <int BITS>
__device__ __forceinline__ void mma_load(const RowRef& lo, const RowRef& hi, int chunk0, int chunks, int group_shift,
                                         int c, MmaPass& p) {
#pragma unroll
    for (int j = 0; j < MMA_PASS; ++j) {
        const int chunk = chunk0 + 4 * j + c;
        const bool in = chunk < chunks;
        const int g = (chunk * (128 / BITS)) >> group_shift;
        const bool have_lo = in && lo.data != nullptr, have_hi = in && hi.data != nullptr;
        p.lo[j] = have_lo ? load_weights(lo.data + chunk) : make_uint4(0, 0, 0, 0);
        p.hi[j] = have_hi ? load_weights(hi.data + chunk) : make_uint4(0, 0, 0, 0);
        p.scale_lo[j] = __float2half2_rn(have_lo ? scale_f32(lo.scales[g]) : 0.0f);
        p.bias_lo[j] = __float2half2_rn(have_lo ? scale_f32(lo.biases[g]) : 0.0f);
        p.scale_hi[j] = __float2half2_rn(have_hi ? scale_f32(hi.scales[g]) : 0.0f);
        p.bias_hi[j] = __float2half2_rn(have_hi ? scale_f32(hi.biases[g]) : 0.0f);
    }
}

// Adds the pass's products with the staged inputs (token t's row at xs + t * stride halves) to
// acc[n] (the C fragment of tokens 8 n .. 8 n + 7: rows g, g + 8 by tokens 8 n + 2c, + 2c + 1):
// each weight fragment is dequantised once for the NT tiles of 8 tokens.
template <int BITS, int NT>
__device__ __forceinline__ void mma_use(const MmaPass& p, int chunk0, int chunks, uint32_t xs, int stride, int g,
                                        int c, float (&acc)[NT][4]) {
    constexpr int VPC = 128 / BITS;  // inputs per 16-byte chunk
#pragma unroll
    for (int j = 0; j < MMA_PASS; ++j) {
        const int chunk = chunk0 + 4 * j + c;
        if (chunk0 + 4 * j >= chunks) break;
        const uint32_t wl[4] = {p.lo[j].x, p.lo[j].y, p.lo[j].z, p.lo[j].w};
        const uint32_t wh[4] = {p.hi[j].x, p.hi[j].y, p.hi[j].z, p.hi[j].w};
        // This lane's inputs: chunk `chunk` of token g's staged row.
        const uint32_t x_at = xs + 2u * (uint32_t)(g * stride + chunk * VPC);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
#pragma unroll
            for (int h = 0; h < (BITS == 4 ? 2 : 1); ++h) {
                // 4-bit: nibble pairs (2h, 2h + 4) and (2h + 1, 2h + 5); 8-bit: bytes (0, 2), (1, 3).
                const int s0 = BITS == 4 ? 8 * h : 0, s1 = BITS == 4 ? 8 * h + 4 : 8;
                uint32_t a[4];
                a[0] = mma_dequant<BITS>(wl[k], s0, p.scale_lo[j], p.bias_lo[j]);
                a[1] = mma_dequant<BITS>(wh[k], s0, p.scale_hi[j], p.bias_hi[j]);
                a[2] = mma_dequant<BITS>(wl[k], s1, p.scale_lo[j], p.bias_lo[j]);
                a[3] = mma_dequant<BITS>(wh[k], s1, p.scale_hi[j], p.bias_hi[j]);
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const uint32_t at = x_at + 2u * (uint32_t)(n * MMA_TOKENS * stride + k * (VPC / 4) + 4 * h);
                    const float2 b = lds64(at);
                    mma_f16_16816(acc[n], a, __float_as_uint(b.x), __float_as_uint(b.y));
                }
            }
        }
    }
}

// y[t] = W x[t] (add[t] + W x[t] when `add` is non-null) for the `tokens` rows of y of a batched decode step, on
// tensor cores, x already staged in fp16 by rows_to_half (the previous launch: row t at
// staged + t * (cols + 4) halves, zeros up to the grid's last token, each product to be
// multiplied by scales[t]): block row blockIdx.y takes tokens NT * MMA_TOKENS * blockIdx.y ..
// + NT * MMA_TOKENS - 1, each weight row read once for all of them. Staging once per launch
// rather than in every block: a block staging all the tokens' rows itself spent half its time
// there (Nsight Compute, 32 tokens). `ksplit` warps (1, 2, 4 or 8) share a tile
// of 16 weight rows, each a slice of its chunks, so that matrices of few rows still spread over
// every SM; the block's warps hold 8 / ksplit tiles at a time, persistent over the rows, and
// add up a tile's slices in shared memory. W: 4- or 8-bit, groups of at least 128 / bits
// inputs, chunks per row (cols * bits / 128) a multiple of 4 * ksplit. Shared memory (mma_smem
// in mod.rs): NT * MMA_TOKENS * (cols + 4) halves (the staged rows as they are in memory), then
// 32 floats (the tokens' scales), then NT * 8 * 32 * 4 floats (the slices' sums).
template <int NT>
__device__ __forceinline__ void matvec_mma_impl(const Weight& w, const __half* staged, const float* scales, float* y,
                                                const float* add, int tokens, int ksplit) {
    extern __shared__ __align__(16) float smem[];
    constexpr int ROWS = NT * MMA_TOKENS;
    const int first = blockIdx.y * ROWS;
    tokens = min(ROWS, tokens - first);
    y += (size_t)first * w.rows;
    if (add != nullptr) add += (size_t)first * w.rows;
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    // Rows of consecutive tokens 2 cols + 8 bytes apart: the 8-byte loads of a warp's 8 tokens
    // and 4 chunks then fall in distinct banks but for pairs.
    const int stride = w.cols + 4;
    __half* xs = reinterpret_cast<__half*>(smem);
    float* out_scale = reinterpret_cast<float*>(xs + ROWS * stride);
    // [n][warp][lane] float4s, 16-byte aligned: after 32 scales.
    float* slices = out_scale + 32;
    const int chunks = (w.cols * w.bits) >> 7;
    const int tiles = (w.rows + 15) >> 4;
    const int per_block = warps / ksplit, slice = warp % ksplit;
    const int span = chunks / ksplit, begin = slice * span, end = begin + span;
    int tile = blockIdx.x * per_block + warp / ksplit;
    MmaPass pass;
    RowRef lo = row_ref(w, tile * 16 + g), hi = row_ref(w, tile * 16 + g + 8);
    // The first pass of this warp's first rows is in flight while the previous kernel finishes.
    if (w.bits == 4) mma_load<4>(lo, hi, begin, end, w.group_shift, c, pass);
    else mma_load<8>(lo, hi, begin, end, w.group_shift, c, pass);
    wait_for_previous_kernel();
    // The block's rows, contiguous in memory as in shared memory (ROWS * stride halves, a whole
    // number of 16-byte pieces: ROWS is a multiple of 8), all requested at once.
    const uint32_t xs_at = shared_address(xs);
    const char* src = reinterpret_cast<const char*>(staged + (size_t)first * stride);
    for (int i = threadIdx.x; i < ROWS * stride / 8; i += blockDim.x) cp_async_16(xs_at + 16 * i, src + 16 * i);
    cp_async_commit();
    if (threadIdx.x < ROWS) out_scale[threadIdx.x] = scales[first + threadIdx.x];
    cp_async_wait<0>();
    __syncthreads();
    // A block-uniform trip count: the slices meet at barriers.
    for (int group = blockIdx.x; group * per_block < tiles; group += gridDim.x) {
        float acc[NT][4] = {};
        for (int chunk0 = begin;;) {
            if (w.bits == 4) mma_use<4, NT>(pass, chunk0, end, xs_at, stride, g, c, acc);
            else mma_use<8, NT>(pass, chunk0, end, xs_at, stride, g, c, acc);
            chunk0 += 4 * MMA_PASS;
            if (chunk0 >= end) break;
            if (w.bits == 4) mma_load<4>(lo, hi, chunk0, end, w.group_shift, c, pass);
            else mma_load<8>(lo, hi, chunk0, end, w.group_shift, c, pass);
        }
        const int row = tile * 16 + g;
        tile += gridDim.x * per_block;
        lo = row_ref(w, tile * 16 + g);
        hi = row_ref(w, tile * 16 + g + 8);
        if (w.bits == 4) mma_load<4>(lo, hi, begin, end, w.group_shift, c, pass);
        else mma_load<8>(lo, hi, begin, end, w.group_shift, c, pass);
        if (ksplit > 1) {
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                float4* mine = reinterpret_cast<float4*>(slices) + (n * warps + warp) * 32 + lane;
                *mine = make_float4(acc[n][0], acc[n][1], acc[n][2], acc[n][3]);
            }
            __syncthreads();
            if (slice == 0) {
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const float4* mine = reinterpret_cast<const float4*>(slices) + (n * warps + warp) * 32 + lane;
                    for (int s = 1; s < ksplit; ++s) {
                        const float4 o = mine[s * 32];
                        acc[n][0] += o.x;
                        acc[n][1] += o.y;
                        acc[n][2] += o.z;
                        acc[n][3] += o.w;
                    }
                }
            }
            __syncthreads();
        }
        // acc[n]: (row, token 8n + 2c), (row, 8n + 2c + 1), (row + 8, 8n + 2c), (row + 8, 8n + 2c + 1).
        if (slice == 0) {
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int t = n * MMA_TOKENS + 2 * c + (i & 1), r = row + 8 * (i >> 1);
                    if (t < tokens && r < w.rows) {
                        const size_t at = (size_t)t * w.rows + r;
                        const float v = acc[n][i] * out_scale[t];
                        y[at] = add != nullptr ? add[at] + v : v;
                    }
                }
        }
    }
}

// matvec_mma_impl for 8, 16 and 32 tokens a block (wider blocks read each weight row once for
// more tokens, but stage more inputs: mma_block_tiles in mod.rs picks).
extern "C" __global__ void __launch_bounds__(256, 2) matvec_mma(Weight w, const __half* staged, const float* scales,
                                                              float* y, const float* add, int tokens, int ksplit) {
    TRACE_BLOCK();
    matvec_mma_impl<1>(w, staged, scales, y, add, tokens, ksplit);
}

extern "C" __global__ void __launch_bounds__(256, 2) matvec_mma_16(Weight w, const __half* staged, const float* scales,
                                                              float* y, const float* add, int tokens, int ksplit) {
    TRACE_BLOCK();
    matvec_mma_impl<2>(w, staged, scales, y, add, tokens, ksplit);
}

extern "C" __global__ void __launch_bounds__(256, 1) matvec_mma_32(Weight w, const __half* staged, const float* scales,
                                                              float* y, const float* add, int tokens, int ksplit) {
    TRACE_BLOCK();
    matvec_mma_impl<4>(w, staged, scales, y, add, tokens, ksplit);
}

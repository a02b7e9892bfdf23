// Prefill matrix products on tensor cores: Y[t, n] = sum_k X[t, k] W[n, k] for a block of tokens
// at once, W in MLX 4-bit or 8-bit (dequantised in registers, never expanded in device memory) or
// dense bf16.
//
// Hopper's warpgroup products (wgmma m64nNk16, N = 128 tokens for dense products and 64 for the
// experts' tiles; fp16 in, f32 accumulate) with the weight rows as the M side, dequantised into
// registers (the A operand), and the tokens as the N side, read by the tensor cores from shared
// memory (the B operand). A dot product does not care in which order it visits k, so each lane
// takes the k values that are cheap for it. 4-bit: in a 32-bit word of 8 nibbles, lane c of a
// quad takes nibbles c and c + 4, which one shift and one LOP3 turn into a half2
// (1024 + q_c, 1024 + q_{c+4}); the inputs are stored with the same permutation,
// (0, 4, 1, 5, 2, 6, 3, 7) within each group of 8, so the matching pair of x values is one
// 32-bit word. 8-bit: lane c takes bytes (c & 1) and (c & 1) + 2 of word c / 2 of the 8 inputs,
// so the inputs are stored as (0, 2, 1, 3, 4, 6, 5, 7).
//
// fp16 holds x after division by a per-token power of two (|x / s| < 2^15); the products
// accumulate in f32 and the epilogue multiplies s back.
//
// bf16 weights are converted to fp16 in registers (exact from 2^-14 up to fp16's largest, smaller
// magnitudes within 2^-25; the host sends only matrices whose every value is under fp16's
// largest, see on_tensor_cores), their inputs in natural order: lane c of a quad takes word c of
// each 16-byte chunk of its 16 inputs.
// fp16 rather than both operands in bf16 (wgmma takes one type for both): bf16 inputs, rounded at
// 2^-9, put the prefill logits 40x further from an f32 reference.

#define GEMM_ROWS 128    // weight rows per block: two 64-row halves
#define GEMM_DENSE_TOKENS 128 // tokens per block of a dense product (the N of the products)
#define GEMM_GROUP_TOKENS 64  // tokens per block of a grouped (MoE) product: an expert's tile
#define GEMM_GROUP_TOKENS_WIDE 128 // the same, for chunks that give the experts more tokens
#define GEMM_THREADS 128 // one warpgroup
#define GEMM_K 64        // inputs per pipeline stage
// Pipeline stages in dynamic shared memory (loads in flight while one is multiplied): four for
// 4/8-bit weights; three for bf16, whose stages are 2-4x larger, so that two blocks of 128 tokens
// (103 KB each) share an SM where four stages (137 KB) left one.
template <int BITS>
__host__ __device__ constexpr int gemm_stages() { return BITS == 16 ? 3 : 4; }

// The lane's pair of quantised values in word w (already shifted right by the lane's offset:
// 4c bits for 4-bit, 8 (c & 1) for 8-bit) as the half2 (scale * q + bias) of each.
template <int BITS>
__device__ __forceinline__ uint32_t dequant_pair(uint32_t w, __half2 scale, __half2 bias) {
    const uint32_t mask = BITS == 4 ? 0x000F000Fu : 0x00FF00FFu;
    const __half2 q = __hsub2(as_half2(mask_or(w, mask, 0x64006400u)), __float2half2_rn(1024.0f));
    const __half2 v = __hfma2(q, scale, bias);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// A pair of bf16 values (first in the low half) as the half2 of the same values.
__device__ __forceinline__ uint32_t bf16_pair_to_half2(uint32_t w) {
    const __half2 h = __floats2half2_rn(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
    return *reinterpret_cast<const uint32_t*>(&h);
}

// The input stored at position i of a row permuted for BITS-bit weights (see above; bf16 weights
// take their inputs in order).
__device__ __forceinline__ int permuted_input(int i, int bits) {
    const int p = i & 7;
    if (bits == 16) return i;
    if (bits == 8) return (i & ~7) + (p & 4) + ((p & 3) == 1 ? 2 : (p & 3) == 2 ? 1 : (p & 3));
    return (i & ~7) + ((p & 1) ? 4 + (p >> 1) : (p >> 1));
}

// Stores the group of eight inputs v at dst (8-byte aligned) in fp16, permuted for `bits`-bit
// weights: position i holds v[permuted_input(i, bits)].
__device__ __forceinline__ void store_eight_permuted(__half* dst, const float (&v)[8], int bits) {
    __align__(16) __half h[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) h[i] = __float2half_rn(v[permuted_input(i, bits)]);
    reinterpret_cast<uint2*>(dst)[0] = reinterpret_cast<const uint2*>(h)[0];
    reinterpret_cast<uint2*>(dst)[1] = reinterpret_cast<const uint2*>(h)[1];
}

// x16[t] = x[t] / xscale[t] in fp16 (RMS-normalised and scaled by norm_scale first when it is
// non-null), inputs permuted within groups of 8 for `bits`-bit weights (see above); xscale[t] is
// the power of two that brings max |x[t]| under 2^15, times row_weight[t * row_weight_stride]
// when row_weight is non-null (a per-token weight of the product's output). Rows of x are
// x_stride floats apart, rows of x16 out_stride halves (a multiple of 4: the decode products'
// shared-memory layout, matvec_mma); rows from `tokens` to the grid's end are zeros (a product's
// tiles padded to whole blocks of tokens). One block of 256 threads per row, a group of 8 inputs
// per thread at a time; K a multiple of 8.
extern "C" __global__ void __launch_bounds__(256) rows_to_half(const float* x, int K, int x_stride,
                                                              const float* norm_scale, float eps, int bits,
                                                              const float* row_weight, int row_weight_stride,
                                                              int tokens, __half* x16, int out_stride,
                                                              float* xscale) {
    __shared__ float scratch[64];
    wait_for_previous_kernel();
    const size_t t = blockIdx.x;
    const bool live = t < (size_t)tokens;
    const float* row = x + t * x_stride;
    const int groups = K / 8;
    float ss = 0.0f, mx = 0.0f;
    for (int gi = threadIdx.x; live && gi < groups; gi += blockDim.x) {
        float v[8], n[8];
        load_eight(row + 8 * gi, v);
        if (norm_scale != nullptr) load_eight(norm_scale + 8 * gi, n);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            ss += v[e] * v[e];
            mx = fmaxf(mx, fabsf(norm_scale != nullptr ? v[e] * n[e] : v[e]));
        }
    }
    const float2 st = block_sum_max(make_float2(ss, mx), scratch);
    const float inv = norm_scale != nullptr ? rsqrtf(st.x / K + eps) : 1.0f;
    mx = st.y * inv;
    const float s = mx > 0.0f ? exp2f(ceilf(log2f(mx)) - 14.0f) : 1.0f;
    const float r = inv / s;
    for (int gi = threadIdx.x; gi < groups; gi += blockDim.x) {
        float v[8] = {}, n[8];
        if (live) load_eight(row + 8 * gi, v);
        if (norm_scale != nullptr) load_eight(norm_scale + 8 * gi, n);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = norm_scale != nullptr ? v[e] * r * n[e] : v[e] * r;
        store_eight_permuted(x16 + t * out_stride + 8 * gi, v, bits);
    }
    if (threadIdx.x == 0) xscale[t] = live && row_weight != nullptr ? s * row_weight[t * row_weight_stride] : s;
}

// The tokens of one block tile: `count` of them from `start`; token i is assignment(i), which
// reads x row assignment(i) / in_div and writes y row assignment(i). A dense product takes
// consecutive tokens; a grouped one (MoE) the assignments of one expert, listed in `order`
// (assignment a = token * top_k + slot), reading the token's row (in_div = top_k).
struct TokenTile {
    int start, count;
    const int* order;  // null: token i is start + i
    int in_div;
    __device__ __forceinline__ int assignment(int i) const { return order != nullptr ? order[start + i] : start + i; }
};

// Copies the aligned 32-bit word holding the 16-bit scale or bias at `global` (4-byte aligned
// allocations) to `smem`.
__device__ __forceinline__ void cp_async_word(uint32_t* smem, const scale_t* global) {
    const uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem);
    const void* src = reinterpret_cast<const void*>(reinterpret_cast<size_t>(global) & ~(size_t)3);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src));
}

// The warpgroup product D (64 rows x 64 tokens, f32) += A (64 rows x 16 inputs, fp16, this
// warp's 16 rows in a0..a3 as for mma.sync m16n8k16) x B (16 inputs x 64 tokens in shared
// memory, described by `desc`). Asynchronous: see wgmma_commit / wgmma_wait.
__device__ __forceinline__ void wgmma_64x64x16(float (&d)[32], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint64_t desc) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, 1, 1, 1, 0;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
}
// As wgmma_64x64x16 for 128 tokens.
__device__ __forceinline__ void wgmma_64x128x16(float (&d)[64], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                uint64_t desc) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, 1, 1, 1, 0;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
}
// Orders this thread's register writes before the next wgmma reads them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most PENDING committed groups of products are still running.
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
}
// Makes this thread's shared-memory writes (cp.async included) visible to the tensor cores'
// reads, which go through the async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Shared-memory matrix descriptor of a K-major operand in the 128-byte swizzled layout (rows of
// 64 fp16 inputs, 8-row groups 1024 bytes apart; see GemmStage), starting `smem` bytes into
// its rows: a k slice of 16 inputs starts 32 bytes further per slice.
__device__ __forceinline__ uint64_t smem_desc_swizzled(const void* smem) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    return (uint64_t)((a >> 4) & 0x3FFF) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}
// Shared-memory matrix descriptor without swizzling: 8x8 core matrices of 16-byte rows, `lead`
// bytes apart along the inputs (K) and `stride` bytes apart along the tokens (N).
__device__ __forceinline__ uint64_t smem_desc(const void* smem, uint32_t lead, uint32_t stride) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    return (uint64_t)((a >> 4) & 0x3FFF) | ((uint64_t)((lead >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((stride >> 4) & 0x3FFF) << 32);
}

// One pipeline stage: the block's 128 weight rows and TOKENS token rows over GEMM_K inputs. A
// row's GEMM_K inputs are BITS / 2 chunks of 16 bytes (32 4-bit, 16 8-bit or 8 bf16 inputs
// each); bf16 rows are swizzled as the tokens' rows below (chunk kb of row r at kb ^ (r % 8)),
// so that the 8 rows a warp reads at once fall in distinct banks. The
// tokens' inputs are in the tensor cores' 128-byte swizzled layout: a token's 64 inputs are one
// 128-byte row, whose 16-byte chunk kb (inputs 8 kb .. 8 kb + 7) sits at position kb ^ (token % 8)
// (so a token's copies, and the tensor cores' reads of 8 tokens, fall in distinct banks; without
// the swizzle the copies of a token's 8 chunks hit one bank 8 times). Stages are 1024-byte
// aligned, as the swizzle requires.
template <int BITS, int TOKENS>
struct GemmStage {
    uint4 x[TOKENS][GEMM_K / 8];
    uint4 w[GEMM_ROWS][BITS / 2];
    // Per row and 32-input half: the words holding its group's scale and bias (unused for bf16).
    uint32_t scale_bias[GEMM_ROWS][2][2];
};

// The warpgroup product D (64 rows x TOKENS tokens, f32) += A (64 rows x 16 inputs in registers)
// x B (16 inputs x TOKENS tokens in shared memory).
template <int TOKENS>
__device__ __forceinline__ void wgmma_tile(float (&d)[TOKENS / 2], const uint32_t (&a)[4], uint64_t desc);
template <>
__device__ __forceinline__ void wgmma_tile<64>(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
    wgmma_64x64x16(d, a[0], a[1], a[2], a[3], desc);
}
template <>
__device__ __forceinline__ void wgmma_tile<128>(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
    wgmma_64x128x16(d, a[0], a[1], a[2], a[3], desc);
}

// y[out(i), r] (+)= sum_k x16[in(i), k] w[row_base + r, k] * xscale[in(i)] (in and out: the
// input and output rows of the tile's token i, see TokenTile) for the tile's tokens (at most
// TOKENS) and the block's 128 rows r from row_block * 128 (below `rows`); y rows are `rows`
// floats wide. The sum runs over split `split` of `splits` equal runs of k (all of k for one
// split). The grids put the token tiles along x, so the blocks that share a row block run
// together and read its weights from DRAM once.
//
// Weights, inputs and the words holding the rows' scales and biases stream through gemm_stages
// stages of dynamic shared memory with cp.async (out-of-range rows and tokens clamped, inputs
// past K zero-filled). The block is one warpgroup: per 16 inputs, warp w dequantises its rows
// 16w .. 16w + 15 of both 64-row halves into registers and the warpgroup issues two
// asynchronous 64 x TOKENS x 16 products, which run while the next 16 inputs are dequantised.
// Dequantising costs the same whatever TOKENS is, so dense products (many tokens) take 128 per
// block.
template <int BITS, int TOKENS>
__device__ __forceinline__ void gemm_tile(const Weight& w, int row_base, int rows, int row_block, int split,
                                          int splits, const TokenTile& tile, const __half* x16, const float* xscale, float* y,
                                          int accumulate) {
    constexpr int CHUNKS = BITS / 2;                           // 16-byte chunks of a row per stage
    constexpr int PER_CHUNK = 128 / BITS;                      // inputs per chunk
    constexpr int W_COPIES = GEMM_ROWS * CHUNKS / GEMM_THREADS;  // per thread and stage
    constexpr int X_COPIES = TOKENS * 8 / GEMM_THREADS;
    constexpr int SB_COPIES = GEMM_ROWS * 4 / GEMM_THREADS;
    constexpr int STAGES = gemm_stages<BITS>();
    using Stage = GemmStage<BITS, TOKENS>;
    extern __shared__ __align__(16) uint4 gemm_smem[];
    // The dynamic shared memory's start rounded up to 1024 bytes (the host adds the slack).
    Stage* stages = reinterpret_cast<Stage*>(
        gemm_smem + ((1024 - ((uint32_t)__cvta_generic_to_shared(gemm_smem) & 1023)) & 1023) / 16);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int K = w.cols, row_chunks = K / PER_CHUNK, groups = K >> w.group_shift;
    // This block's share of the K steps: split `split` of `splits` equal runs.
    const int all_steps = (K + GEMM_K - 1) / GEMM_K, per_split = (all_steps + splits - 1) / splits;
    const int first_step = split * per_split, steps = max(0, min(per_split, all_steps - first_step));
    const uint4* wdata = reinterpret_cast<const uint4*>(w.data);
    const int first_row = row_base + row_block * GEMM_ROWS, last_row = row_base + rows - 1;

    // The tile's tokens, looked up once: input row, output row and input scale of each.
    __shared__ int tile_in[TOKENS], tile_out[TOKENS];
    __shared__ float tile_scale[TOKENS];
    for (int i = tid; i < TOKENS; i += GEMM_THREADS) {
        const int a = tile.assignment(min(i, tile.count - 1));
        tile_out[i] = a;
        tile_in[i] = a / tile.in_div;
        tile_scale[i] = xscale[a / tile.in_div];
    }
    __syncthreads();

    // This thread's copies per stage. Copy i of a kind is number q = tid + i * GEMM_THREADS:
    // weights row q / CHUNKS, chunk q % CHUNKS; inputs token q / 8, k block q % 8; scale or bias
    // words row q / 4, half (q / 2) % 2, scale (q even) or bias. Only the row or token changes
    // with i. With groups of 64 inputs or more a stage's inputs share one group: its words are
    // copied once, as half 0 (row q / 2), half the copies.
    const bool one_group = w.group_shift >= 6;
    const int w_chunk = tid % CHUNKS, x_block = tid & 7, sb_half = (tid >> 1) & 1;
    const scale_t* sb_base = (tid & 1) ? w.biases : w.scales;
    int x_rows[X_COPIES];
#pragma unroll
    for (int i = 0; i < X_COPIES; ++i) x_rows[i] = tile_in[(tid >> 3) + i * (GEMM_THREADS / 8)];
    auto issue = [&](int stage, int step) {
        Stage& st = stages[stage];
        const int k0 = (first_step + step) * GEMM_K;
        if constexpr (BITS != 16) {
            if (one_group) {
                const int grp = min(k0 >> w.group_shift, groups - 1);
#pragma unroll
                for (int i = 0; i < SB_COPIES / 2; ++i) {
                    const int row = (tid >> 1) + i * (GEMM_THREADS / 2);
                    const size_t r = min(first_row + row, last_row);
                    cp_async_word(&st.scale_bias[row][0][tid & 1], sb_base + r * groups + grp);
                }
            } else {
                const int grp = min((k0 + 32 * sb_half) >> w.group_shift, groups - 1);
#pragma unroll
                for (int i = 0; i < SB_COPIES; ++i) {
                    const int row = (tid >> 2) + i * (GEMM_THREADS / 4);
                    const size_t r = min(first_row + row, last_row);
                    cp_async_word(&st.scale_bias[row][sb_half][tid & 1], sb_base + r * groups + grp);
                }
            }
        }
        const bool w_valid = k0 + PER_CHUNK * w_chunk < K;
#pragma unroll
        for (int i = 0; i < W_COPIES; ++i) {
            const int row = tid / CHUNKS + i * (GEMM_THREADS / CHUNKS);
            const size_t r = min(first_row + row, last_row);
            const int slot = BITS == 16 ? w_chunk ^ (row & 7) : w_chunk;
            cp_async_16(shared_address(&st.w[row][slot]), w_valid ? wdata + r * row_chunks + CHUNKS * (first_step + step) + w_chunk : wdata, w_valid);
        }
        const bool x_valid = k0 + 8 * x_block < K;
#pragma unroll
        for (int i = 0; i < X_COPIES; ++i) {
            const int token = (tid >> 3) + i * (GEMM_THREADS / 8);
            cp_async_16(shared_address(&st.x[token][x_block ^ (token & 7)]), x_valid ? x16 + (size_t)x_rows[i] * K + k0 + 8 * x_block : x16, x_valid);
        }
    };

    // The lane's shift within a word: its nibble pair (4-bit) or byte pair (8-bit).
    const int shift = BITS == 4 ? 4 * c : 8 * (c & 1);

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps) issue(s, s);
        cp_async_commit();
    }
    // Which half of its scale and bias words each of this lane's rows (16 warp + g and + 8 of
    // each 64-row half) reads at group 0: the parity of the row's first group index.
    int row_parity[2][2] = {};
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const size_t r = min(first_row + 64 * m + 16 * warp + 8 * h + g, last_row);
            if constexpr (BITS != 16) row_parity[m][h] = (int)((r * groups) & 1);
        }
    float acc[2][TOKENS / 2] = {};
    for (int step = 0; step < steps; ++step) {
        cp_async_wait<STAGES - 2>();
        fence_proxy_async();
        __syncthreads();
        const int ahead = step + STAGES - 1;
        if (ahead < steps) issue(ahead % STAGES, ahead);
        cp_async_commit();

        const Stage& st = stages[step % STAGES];
        __half2 scale[2][2][2], bias[2][2][2];
        if constexpr (BITS != 16) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int grp = min(((first_step + step) * GEMM_K + 32 * hh) >> w.group_shift, groups - 1);
#pragma unroll
                for (int m = 0; m < 2; ++m)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        if (hh == 1 && one_group) {
                            scale[m][h][1] = scale[m][h][0];
                            bias[m][h][1] = bias[m][h][0];
                            continue;
                        }
                        const int row = 64 * m + 16 * warp + 8 * h + g;
                        const int high = (row_parity[m][h] ^ grp) & 1;
                        const uint32_t sw = st.scale_bias[row][hh][0] >> (16 * high);
                        const uint32_t bw = st.scale_bias[row][hh][1] >> (16 * high);
                        scale[m][h][hh] = __float2half2_rn(scale_bits_f32((uint16_t)sw));
                        bias[m][h][hh] = __float2half2_rn(scale_bits_f32((uint16_t)bw));
                    }
            }
        }
        // Step j covers inputs 16j .. 16j + 15 of the stage: for 4-bit, words 2 (j % 2) and
        // 2 (j % 2) + 1 of chunk j / 2 (8 inputs each); for 8-bit, words c / 2 and 2 + c / 2
        // of chunk j (4 inputs each); for bf16, word c of chunks 2j and 2j + 1 (8 inputs each).
        // A registers alternate between two sets, so that step j's can be written while step
        // j - 1's products still read theirs.
        uint32_t a[2][2][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int hh = j >> 1;
            uint32_t (&aj)[2][4] = a[j & 1];
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                const int row = 64 * m + 16 * warp + g;
                if constexpr (BITS == 16) {
                    // Rows g and g + 8 hold chunk kb at kb ^ g (row % 8 is g).
                    const uint32_t* lo = reinterpret_cast<const uint32_t*>(&st.w[row][0]);
                    const uint32_t* hi = reinterpret_cast<const uint32_t*>(&st.w[row + 8][0]);
                    const int first = 4 * ((2 * j) ^ g) + c, second = 4 * ((2 * j + 1) ^ g) + c;
                    aj[m][0] = bf16_pair_to_half2(lo[first]);
                    aj[m][1] = bf16_pair_to_half2(hi[first]);
                    aj[m][2] = bf16_pair_to_half2(lo[second]);
                    aj[m][3] = bf16_pair_to_half2(hi[second]);
                } else {
                    const uint4 lo = st.w[row][BITS == 4 ? hh : j], hi = st.w[row + 8][BITS == 4 ? hh : j];
                    // (x, y) or (z, w) for 4-bit (by j, known at compile time); (x, z) or (y, w)
                    // for 8-bit (by lane: selects, not an indexed local array, which would live
                    // on the stack).
                    const bool odd = BITS == 4 ? (j & 1) : (c >> 1);
                    const uint32_t l0 = BITS == 4 ? (odd ? lo.z : lo.x) : (odd ? lo.y : lo.x);
                    const uint32_t l1 = BITS == 4 ? (odd ? lo.w : lo.y) : (odd ? lo.w : lo.z);
                    const uint32_t u0 = BITS == 4 ? (odd ? hi.z : hi.x) : (odd ? hi.y : hi.x);
                    const uint32_t u1 = BITS == 4 ? (odd ? hi.w : hi.y) : (odd ? hi.w : hi.z);
                    aj[m][0] = dequant_pair<BITS>(l0 >> shift, scale[m][0][hh], bias[m][0][hh]);
                    aj[m][1] = dequant_pair<BITS>(u0 >> shift, scale[m][1][hh], bias[m][1][hh]);
                    aj[m][2] = dequant_pair<BITS>(l1 >> shift, scale[m][0][hh], bias[m][0][hh]);
                    aj[m][3] = dequant_pair<BITS>(u1 >> shift, scale[m][1][hh], bias[m][1][hh]);
                }
            }
            // Inputs 16j .. 16j + 15 are k blocks 2j and 2j + 1.
            const uint64_t desc = smem_desc_swizzled(reinterpret_cast<const char*>(&st.x[0][0]) + 32 * j);
            wgmma_fence();
#pragma unroll
            for (int m = 0; m < 2; ++m) wgmma_tile<TOKENS>(acc[m], aj[m], desc);
            wgmma_commit();
            // Step j - 1's products are done, so its A registers may be rewritten at j + 1.
            wgmma_wait<1>();
        }
        // All of this stage's products are done before the next barrier lets its buffer
        // refill.
        wgmma_wait<0>();
    }

    // D fragment of each 64-row half m: acc[m][4 nb + e] is row 16 warp + g (+ 8 for
    // e >= 2), token 8 nb + 2c + (e & 1).
    const int row0 = row_block * GEMM_ROWS;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int i = 0; i < TOKENS / 2; ++i) {
            const int r = row0 + 64 * m + 16 * warp + g + ((i & 2) ? 8 : 0);
            const int t = 8 * (i >> 2) + 2 * c + (i & 1);
            if (r >= rows || t >= tile.count) continue;
            const float v = acc[m][i] * tile_scale[t];
            float* out = y + (size_t)tile_out[t] * rows + r;
            *out = accumulate ? *out + v : v;
        }
    cp_async_wait<0>();
}

// gemm_tile for the weight's width (4, 8 or 16 bits; the host sends nothing else).
template <int TOKENS>
__device__ __forceinline__ void gemm_tile_bits(const Weight& w, int row_base, int rows, int row_block, int split,
                                               int splits, const TokenTile& tile, const __half* x16, const float* xscale,
                                               float* y, int accumulate) {
    if (w.bits == 16)
        gemm_tile<16, TOKENS>(w, row_base, rows, row_block, split, splits, tile, x16, xscale, y, accumulate);
    else if (w.bits == 8)
        gemm_tile<8, TOKENS>(w, row_base, rows, row_block, split, splits, tile, x16, xscale, y, accumulate);
    else
        gemm_tile<4, TOKENS>(w, row_base, rows, row_block, split, splits, tile, x16, xscale, y, accumulate);
}

// y[t, n] = sum_k x[t, k] w[n, k] (added to y when `accumulate`), y row-major [tokens, w.rows];
// x16 and xscale from rows_to_half. Blocks with blockIdx.z >= splits do the same with w2 into y2
// (the shared expert's up projection beside its gate one: same shape, format and inputs). With
// splits > 1 (products of few blocks, the router) block z % splits sums its split of k into
// y + split * tokens * rows, for the reader to add up. w: 4- or 8-bit, group size >= 32. Grid:
// (ceil(tokens / GEMM_DENSE_TOKENS), ceil(rows / 128), splits or 2 splits), GEMM_THREADS
// threads, gemm_smem_bytes(bits, GEMM_DENSE_TOKENS) of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2) gemm_q(Weight w, Weight w2, const __half* x16,
                                                                 const float* xscale, int tokens, float* y, float* y2,
                                                                 int accumulate, int splits) {
    wait_for_previous_kernel();
    const int start = blockIdx.x * GEMM_DENSE_TOKENS;
    const TokenTile tile = {start, min(GEMM_DENSE_TOKENS, tokens - start), nullptr, 1};
    const int split = blockIdx.z % splits;
    // Field by field, so that the choice stays in registers (a whole-struct select goes through
    // the stack).
    const bool second = blockIdx.z >= splits;
    Weight m = w;
    m.data = second ? w2.data : w.data;
    m.scales = second ? w2.scales : w.scales;
    m.biases = second ? w2.biases : w.biases;
    float* out = (second ? y2 : y) + (size_t)split * tokens * w.rows;
    gemm_tile_bits<GEMM_DENSE_TOKENS>(m, 0, w.rows, blockIdx.y, split, splits, tile, x16, xscale, out, accumulate);
}

// The MoE experts' products over their tokens: w stacks the experts' matrices
// [experts * rows_per_expert, cols]; tile blockIdx.x of `tiles` (expert, start, count in
// `order`, at most TOKENS; tiles beyond tile_count[0] exit) multiplies that expert's rows by its
// assignments' x rows (assignment / in_div) into y rows per assignment ([assignments,
// rows_per_expert]). Blocks with blockIdx.z == 1 do the same with w2 into y2 (the up projection
// beside the gate one, from the same inputs; same shape and format). Grid: (most tiles,
// ceil(rows_per_expert / 128), 1 or 2), GEMM_THREADS threads, gemm_smem_bytes(bits, TOKENS) of
// dynamic shared memory.
template <int TOKENS>
__device__ __forceinline__ void gemm_grouped(const Weight& w, const Weight& w2, int rows_per_expert, const int* tiles,
                                             const int* tile_count, const int* order, int in_div, const __half* x16,
                                             const float* xscale, float* y, float* y2) {
    wait_for_previous_kernel();
    if ((int)blockIdx.x >= tile_count[0]) return;
    const int* t = tiles + 3 * blockIdx.x;
    const TokenTile tile = {t[1], t[2], order, in_div};
    // Field by field, so that the choice stays in registers (a whole-struct select goes through
    // the stack).
    const bool second = blockIdx.z == 1;
    Weight m = w;
    m.data = second ? w2.data : w.data;
    m.scales = second ? w2.scales : w.scales;
    m.biases = second ? w2.biases : w.biases;
    gemm_tile_bits<TOKENS>(m, t[0] * rows_per_expert, rows_per_expert, blockIdx.y, 0, 1, tile, x16, xscale,
                           second ? y2 : y, 0);
}

// Tiles of GEMM_GROUP_TOKENS: three blocks per SM.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS) gemm_q_grouped(Weight w, Weight w2, int rows_per_expert,
                                                                         const int* tiles, const int* tile_count,
                                                                         const int* order, int in_div,
                                                                         const __half* x16, const float* xscale,
                                                                         float* y, float* y2) {
    gemm_grouped<GEMM_GROUP_TOKENS>(w, w2, rows_per_expert, tiles, tile_count, order, in_div, x16, xscale, y, y2);
}

// Tiles of GEMM_GROUP_TOKENS_WIDE (wgmma n128, as the dense products): each dequantised weight
// fragment serves twice the tokens, two blocks per SM.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS) gemm_q_grouped_wide(Weight w, Weight w2,
                                                                              int rows_per_expert, const int* tiles,
                                                                              const int* tile_count, const int* order,
                                                                              int in_div, const __half* x16,
                                                                              const float* xscale, float* y, float* y2) {
    gemm_grouped<GEMM_GROUP_TOKENS_WIDE>(w, w2, rows_per_expert, tiles, tile_count, order, in_div, x16, xscale, y,
                                         y2);
}

// act16[a] = (silu(gate[a]) * up[a] * weight) in fp16, scaled and permuted as rows_to_half does,
// for each of the `rows` rows a of gate and up ([rows, width]); the row's weight is
// weights[(a / per) * stride + a % per + offset] (routed assignments: per = top_k, stride =
// top_k + 1, offset 0; the shared expert: per = 1, offset = top_k). One warp per row, a group of
// 8 values per lane at a time, 8 rows per block of 256 threads; width a multiple of 8; permuted
// for `bits`-bit weights.
extern "C" __global__ void __launch_bounds__(256) swiglu_to_half(const float* gate, const float* up,
                                                                const float* weights, int per, int stride, int offset,
                                                                int width, int bits, int rows, __half* act16,
                                                                float* actscale) {
    wait_for_previous_kernel();
    const int lane = threadIdx.x & 31;
    const size_t a = (size_t)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (a >= (size_t)rows) return;
    const float wa = weights[(a / per) * stride + a % per + offset];
    const float *g_row = gate + a * width, *u_row = up + a * width;
    const int groups = width / 8;
    float mx = 0.0f;
    for (int gi = lane; gi < groups; gi += 32) {
        float g[8], u[8];
        load_eight(g_row + 8 * gi, g);
        load_eight(u_row + 8 * gi, u);
#pragma unroll
        for (int e = 0; e < 8; ++e) mx = fmaxf(mx, fabsf(silu(g[e]) * u[e] * wa));
    }
    mx = warp_max(mx);
    const float s = mx > 0.0f ? exp2f(ceilf(log2f(mx)) - 14.0f) : 1.0f;
    const float r = wa / s;
    for (int gi = lane; gi < groups; gi += 32) {
        float g[8], u[8];
        load_eight(g_row + 8 * gi, g);
        load_eight(u_row + 8 * gi, u);
#pragma unroll
        for (int e = 0; e < 8; ++e) g[e] = silu(g[e]) * u[e] * r;
        store_eight_permuted(act16 + a * width + 8 * gi, g, bits);
    }
    if (lane == 0) actscale[a] = s;
}

// residual[t] += sum over slots of down[t * top_k + slot]: the routed experts' outputs (their
// routing weights already applied) for each token t. Grid: (ceil(hidden / 256), tokens).
extern "C" __global__ void __launch_bounds__(256) add_expert_rows(const float* down, int top_k, int hidden,
                                                                 float* residual) {
    wait_for_previous_kernel();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= hidden) return;
    const size_t t = blockIdx.y;
    float sum = 0.0f;
    for (int k = 0; k < top_k; ++k) sum += down[(t * top_k + k) * hidden + i];
    residual[t * hidden + i] += sum;
}

// The tensor-core rate this GPU sustains for the wgmma m64n64k16 fp16 products the prefill
// kernels use: each warpgroup runs `iters` rounds of eight products on registers and a zeroed
// shared-memory B (no global memory traffic). The sums go to out only if they equal an
// impossible value, so the compiler keeps the work. Grid: any, 128 threads.
extern "C" __global__ void __launch_bounds__(128) wgmma_peak(int iters, float* out) {
    __shared__ __align__(128) uint4 b[2][GEMM_GROUP_TOKENS];
    for (int i = threadIdx.x; i < 2 * GEMM_GROUP_TOKENS; i += blockDim.x)
        b[i / GEMM_GROUP_TOKENS][i % GEMM_GROUP_TOKENS] = make_uint4(0, 0, 0, 0);
    fence_proxy_async();
    __syncthreads();
    const uint64_t desc = smem_desc(&b[0][0], GEMM_GROUP_TOKENS * 16, 128);
    const uint32_t a = 0x3c003c00u ^ threadIdx.x;
    float acc[2][32] = {};
    for (int i = 0; i < iters; ++i) {
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            wgmma_64x64x16(acc[0], a, a, a, a, desc);
            wgmma_64x64x16(acc[1], a, a, a, a, desc);
        }
        wgmma_commit();
        wgmma_wait<0>();
    }
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; ++i) sum += acc[0][i] + acc[1][i];
    if (sum == -1.2345e-30f) out[threadIdx.x] = sum;
}

// Prefill matrix products on tensor cores: Y[t, n] = sum_k X[t, k] W[n, k] for a block of tokens
// at once, W in MLX 4-bit or 8-bit (dequantised in registers, never expanded in device memory).
//
// mma.sync m16n8k16 (fp16 in, f32 accumulate) with the weight rows as the M side and the tokens
// as the N side. A dot product does not care in which order it visits k, so each lane takes the
// k values that are cheap for it. 4-bit: in a 32-bit word of 8 nibbles, lane c of a quad takes
// nibbles c and c + 4, which one shift and one LOP3 turn into a half2 (1024 + q_c, 1024 + q_{c+4});
// the inputs are stored with the same permutation, (0, 4, 1, 5, 2, 6, 3, 7) within each group of
// 8, so the matching pair of x values is one 32-bit word. 8-bit: lane c takes bytes (c & 1) and
// (c & 1) + 2 of word c / 2 of the 8 inputs, so the inputs are stored as (0, 2, 1, 3, 4, 6, 5, 7).
//
// fp16 holds x after division by a per-token power of two (|x / s| < 2^15); the products
// accumulate in f32 and the epilogue multiplies s back.

#define GEMM_ROWS 128    // weight rows per block: 4 warps of 32
#define GEMM_TOKENS 64   // tokens per block: every warp takes all 64
#define GEMM_THREADS 128 // 4 warps
#define GEMM_K 64        // inputs per pipeline stage
#define GEMM_STAGES 4    // stages in dynamic shared memory: three loads in flight while one is multiplied
#define GEMM_X_STRIDE 36 // 32-bit words per token row in shared memory (32 + 4: ldmatrix rows
                         // of consecutive tokens fall in different banks)

__device__ __forceinline__ void mma_f16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                              uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The lane's pair of quantised values in word w (already shifted right by the lane's offset:
// 4c bits for 4-bit, 8 (c & 1) for 8-bit) as the half2 (scale * q + bias) of each.
template <int BITS>
__device__ __forceinline__ uint32_t dequant_pair(uint32_t w, __half2 scale, __half2 bias) {
    const uint32_t mask = BITS == 4 ? 0x000F000Fu : 0x00FF00FFu;
    const __half2 q = __hsub2(as_half2(mask_or(w, mask, 0x64006400u)), __float2half2_rn(1024.0f));
    const __half2 v = __hfma2(q, scale, bias);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// The input stored at position i of a row permuted for BITS-bit weights (see above).
__device__ __forceinline__ int permuted_input(int i, int bits) {
    const int p = i & 7;
    if (bits == 8) return (i & ~7) + (p & 4) + ((p & 3) == 1 ? 2 : (p & 3) == 2 ? 1 : (p & 3));
    return (i & ~7) + ((p & 1) ? 4 + (p >> 1) : (p >> 1));
}

// x16[t] = x[t] / xscale[t] in fp16 (RMS-normalised and scaled by norm_scale first when it is
// non-null), inputs permuted within groups of 8 for `bits`-bit weights (see above); xscale[t] is
// the power of two that brings max |x[t]| under 2^15. One block of 256 threads per token; K a
// multiple of 8.
extern "C" __global__ void __launch_bounds__(256) rows_to_half(const float* x, int K, const float* norm_scale, float eps,
                                                              int bits, __half* x16, float* xscale) {
    __shared__ float scratch[64];
    wait_for_previous_kernel();
    const size_t t = blockIdx.x;
    const float* row = x + t * K;
    float ss = 0.0f, mx = 0.0f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) {
        const float v = row[i];
        ss += v * v;
        mx = fmaxf(mx, fabsf(norm_scale != nullptr ? v * norm_scale[i] : v));
    }
    const float2 st = block_sum_max(make_float2(ss, mx), scratch);
    const float inv = norm_scale != nullptr ? rsqrtf(st.x / K + eps) : 1.0f;
    mx = st.y * inv;
    const float s = mx > 0.0f ? exp2f(ceilf(log2f(mx)) - 14.0f) : 1.0f;
    const float r = inv / s;
    for (int i = threadIdx.x; i < K; i += blockDim.x) {
        const int src = permuted_input(i, bits);
        const float v = row[src] * r;
        x16[t * K + i] = __float2half_rn(norm_scale != nullptr ? v * norm_scale[src] : v);
    }
    if (threadIdx.x == 0) xscale[t] = s;
}

// The tokens of one block tile: `count` of them from `start`; token i reads x row in_row(i) and
// writes y row out_row(i). A dense product takes consecutive tokens; a grouped one (MoE) the
// assignments of one expert, listed in `order` (assignment a = token * top_k + slot), reading
// the token's row (a / in_div) and writing the assignment's row (a).
struct TokenTile {
    int start, count;
    const int* order;  // null: token i is start + i
    int in_div;
    __device__ __forceinline__ int assignment(int i) const { return order != nullptr ? order[start + i] : start + i; }
    __device__ __forceinline__ int in_row(int i) const { return assignment(i) / in_div; }
};

__device__ __forceinline__ void cp_async_16(void* smem, const void* global, bool valid) {
    const uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(global), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING));
}

// Four 8x8 fp16 matrices from shared memory; lane l gives the address of row l % 8 of matrix l / 8
// and receives, from each matrix, the pair at (row l / 4, columns 2 (l % 4), + 1).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// One pipeline stage: the block's 128 weight rows and 64 token rows over GEMM_K inputs. A row's
// GEMM_K inputs are BITS / 2 chunks of 16 bytes (32 4-bit or 16 8-bit inputs each).
template <int BITS>
struct GemmStage {
    uint4 w[GEMM_ROWS][BITS / 2];
    uint32_t x[GEMM_TOKENS][GEMM_X_STRIDE];  // 64 fp16 inputs (32 words) per token, padded
};

// y[out_row(i), r] (+)= sum_k x16[in_row(i), k] w[row_base + r, k] * xscale[in_row(i)] for the
// block's 128 rows r from row_block * 128 (below `rows`) and the tile's tokens; y rows are `rows`
// floats wide. The grids put the token tiles along x, so the blocks that share a row block run
// together and read its weights from DRAM once.
//
// Weights and inputs stream through GEMM_STAGES stages of dynamic shared memory with cp.async
// (out-of-range rows clamped, inputs past K zero-filled); warp w multiplies rows 32w .. 32w + 31
// by all 64 tokens: per 16 inputs, 8 dequantised A registers and 4 ldmatrix loads feed 16
// products. The scales and biases of the next stage are loaded into registers while this one is
// multiplied.
template <int BITS>
__device__ __forceinline__ void gemm_tile(const Weight& w, int row_base, int rows, int row_block,
                                          const TokenTile& tile, const __half* x16, const float* xscale, float* y,
                                          int accumulate) {
    constexpr int CHUNKS = BITS / 2;         // 16-byte chunks of a row per stage
    constexpr int PER_CHUNK = 128 / BITS;    // inputs per chunk
    extern __shared__ __align__(16) uint4 gemm_smem[];
    GemmStage<BITS>* stages = reinterpret_cast<GemmStage<BITS>*>(gemm_smem);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int K = w.cols, row_chunks = K / PER_CHUNK, groups = K >> w.group_shift;
    const int steps = (K + GEMM_K - 1) / GEMM_K;
    const uint4* wdata = reinterpret_cast<const uint4*>(w.data);

    // Copies of this thread per stage: CHUNKS weight chunks and 4 input chunks.
    const uint4* wsrc[CHUNKS];
    int wdst_row[CHUNKS], wdst_chunk[CHUNKS];
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        const int q = threadIdx.x + i * GEMM_THREADS;
        wdst_row[i] = q / CHUNKS;
        wdst_chunk[i] = q % CHUNKS;
        const size_t r = row_base + min(row_block * GEMM_ROWS + wdst_row[i], rows - 1);
        wsrc[i] = wdata + r * row_chunks + wdst_chunk[i];
    }
    const __half* xsrc[4];
    int xdst_tok[4], xdst_part[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int q = threadIdx.x + i * GEMM_THREADS;
        xdst_tok[i] = q >> 3;
        xdst_part[i] = q & 7;
        const int t = min(xdst_tok[i], tile.count - 1);
        xsrc[i] = x16 + (size_t)tile.in_row(t) * K + 8 * xdst_part[i];
    }
    auto issue = [&](int stage, int step) {
        GemmStage<BITS>& st = stages[stage];
        const int k0 = step * GEMM_K;
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            const bool valid = k0 + PER_CHUNK * wdst_chunk[i] < K;
            cp_async_16(&st.w[wdst_row[i]][wdst_chunk[i]], valid ? wsrc[i] + CHUNKS * step : wdata, valid);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const bool valid = k0 + 8 * xdst_part[i] < K;
            cp_async_16(&st.x[xdst_tok[i]][4 * xdst_part[i]], valid ? xsrc[i] + k0 : x16, valid);
        }
    };

    // This lane's weight rows: g, g + 8 of each of the warp's two 16-row tiles; their scale and
    // bias for each 32-input half of a stage (groups hold at least 32 inputs).
    const bf16* srow[2][2];
    const bf16* brow[2][2];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const size_t r = row_base + min(row_block * GEMM_ROWS + warp * 32 + 16 * m + 8 * h + g, rows - 1);
            srow[m][h] = w.scales + r * groups;
            brow[m][h] = w.biases + r * groups;
        }
    bf16 next_scale[2][2][2], next_bias[2][2][2];
    auto load_scales = [&](int step) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int grp = min((step * GEMM_K + 32 * hh) >> w.group_shift, groups - 1);
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    next_scale[m][h][hh] = srow[m][h][grp];
                    next_bias[m][h][hh] = brow[m][h][grp];
                }
        }
    };

    // n-tiles (8 tokens) of the tile that hold tokens: the rest are skipped.
    const int live_tiles = (tile.count + 7) >> 3;
    // The lane's shift within a word: its nibble pair (4-bit) or byte pair (8-bit).
    const int shift = BITS == 4 ? 4 * c : 8 * (c & 1);
    float acc[2][8][4] = {};

#pragma unroll
    for (int s = 0; s < GEMM_STAGES - 1; ++s) {
        if (s < steps) issue(s, s);
        cp_async_commit();
    }
    load_scales(0);
    for (int step = 0; step < steps; ++step) {
        cp_async_wait<GEMM_STAGES - 2>();
        __syncthreads();
        const int ahead = step + GEMM_STAGES - 1;
        if (ahead < steps) issue(ahead % GEMM_STAGES, ahead);
        cp_async_commit();
        __half2 scale[2][2][2], bias[2][2][2];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    scale[m][h][hh] = __float2half2_rn(__bfloat162float(next_scale[m][h][hh]));
                    bias[m][h][hh] = __float2half2_rn(__bfloat162float(next_bias[m][h][hh]));
                }
        if (step + 1 < steps) load_scales(step + 1);

        const GemmStage<BITS>& st = stages[step % GEMM_STAGES];
        // Step j covers inputs 16j .. 16j + 15 of the stage: for 4-bit, words 2 (j % 2) and
        // 2 (j % 2) + 1 of chunk j / 2 (8 inputs each); for 8-bit, words c / 2 and 2 + c / 2 of
        // chunk j (4 inputs each).
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int hh = j >> 1;
            uint32_t a[2][4];
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                const int row = warp * 32 + 16 * m + g;
                const uint4 lo = st.w[row][BITS == 4 ? hh : j], hi = st.w[row + 8][BITS == 4 ? hh : j];
                // (x, y) or (z, w) for 4-bit (by j, known at compile time); (x, z) or (y, w) for
                // 8-bit (by lane: selects, not an indexed local array, which would live on the stack).
                const bool odd = BITS == 4 ? (j & 1) : (c >> 1);
                const uint32_t l0 = BITS == 4 ? (odd ? lo.z : lo.x) : (odd ? lo.y : lo.x);
                const uint32_t l1 = BITS == 4 ? (odd ? lo.w : lo.y) : (odd ? lo.w : lo.z);
                const uint32_t u0 = BITS == 4 ? (odd ? hi.z : hi.x) : (odd ? hi.y : hi.x);
                const uint32_t u1 = BITS == 4 ? (odd ? hi.w : hi.y) : (odd ? hi.w : hi.z);
                a[m][0] = dequant_pair<BITS>(l0 >> shift, scale[m][0][hh], bias[m][0][hh]);
                a[m][1] = dequant_pair<BITS>(u0 >> shift, scale[m][1][hh], bias[m][1][hh]);
                a[m][2] = dequant_pair<BITS>(l1 >> shift, scale[m][0][hh], bias[m][0][hh]);
                a[m][3] = dequant_pair<BITS>(u1 >> shift, scale[m][1][hh], bias[m][1][hh]);
            }
            // ldmatrix: matrices (tile n, words 8j..8j+3), (tile n, 8j+4..), (n + 1, 8j..), (n + 1, 8j+4..).
            const int mat = lane >> 3, r = lane & 7;
#pragma unroll
            for (int n = 0; n < 8; n += 2) {
                if (n >= live_tiles) break;
                uint32_t b[4];
                ldmatrix_x4(b, &st.x[8 * (n + (mat >> 1)) + r][8 * j + 4 * (mat & 1)]);
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    mma_f16_16816(acc[m][n], a[m][0], a[m][1], a[m][2], a[m][3], b[0], b[1]);
                    mma_f16_16816(acc[m][n + 1], a[m][0], a[m][1], a[m][2], a[m][3], b[2], b[3]);
                }
            }
        }
    }
    cp_async_wait<0>();

    // D fragment: d0, d1 = (row g, tokens 2c, 2c + 1); d2, d3 = (row g + 8, same tokens).
    const int row0 = row_block * GEMM_ROWS + warp * 32;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = row0 + 16 * m + g + (e >= 2 ? 8 : 0);
                const int i = 8 * n + 2 * c + (e & 1);
                if (r >= rows || i >= tile.count) continue;
                const float v = acc[m][n][e] * xscale[tile.in_row(i)];
                float* out = y + (size_t)tile.assignment(i) * rows + r;
                *out = accumulate ? *out + v : v;
            }
}

// gemm_tile for the weight's width (4 or 8 bits; the host sends nothing else).
__device__ __forceinline__ void gemm_tile_bits(const Weight& w, int row_base, int rows, int row_block,
                                               const TokenTile& tile, const __half* x16, const float* xscale,
                                               float* y, int accumulate) {
    if (w.bits == 8)
        gemm_tile<8>(w, row_base, rows, row_block, tile, x16, xscale, y, accumulate);
    else
        gemm_tile<4>(w, row_base, rows, row_block, tile, x16, xscale, y, accumulate);
}

// y[t, n] = sum_k x[t, k] w[n, k] (added to y when `accumulate`), y row-major [tokens, w.rows];
// x16 and xscale from rows_to_half. w: 4- or 8-bit, group size >= 32. Grid: (ceil(tokens / 64),
// ceil(rows / 128)), GEMM_THREADS threads, gemm_smem_bytes(bits) of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 3) gemm_q(Weight w, const __half* x16, const float* xscale,
                                                                 int tokens, float* y, int accumulate) {
    wait_for_previous_kernel();
    const int start = blockIdx.x * GEMM_TOKENS;
    const TokenTile tile = {start, min(GEMM_TOKENS, tokens - start), nullptr, 1};
    gemm_tile_bits(w, 0, w.rows, blockIdx.y, tile, x16, xscale, y, accumulate);
}

// The MoE experts' products over their tokens: w stacks the experts' matrices
// [experts * rows_per_expert, cols]; tile blockIdx.x of `tiles` (expert, start, count in
// `order`, at most 64 tokens; tiles beyond tile_count[0] exit) multiplies that expert's rows by
// its assignments' x rows (assignment / in_div) into y rows per assignment
// ([assignments, rows_per_expert]). Blocks with blockIdx.z == 1 do the same with w2 into y2
// (the up projection beside the gate one, from the same inputs; same shape and format). Grid: (most tiles,
// ceil(rows_per_expert / 128), 1 or 2), GEMM_THREADS threads, gemm_smem_bytes(bits) of dynamic
// shared memory.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS) gemm_q_grouped(Weight w, Weight w2, int rows_per_expert,
                                                                         const int* tiles, const int* tile_count,
                                                                         const int* order, int in_div,
                                                                         const __half* x16, const float* xscale,
                                                                         float* y, float* y2) {
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
    gemm_tile_bits(m, t[0] * rows_per_expert, rows_per_expert, blockIdx.y, tile, x16, xscale, second ? y2 : y, 0);
}

// act16[a] = (silu(gate[a]) * up[a] * weight) in fp16, scaled and permuted as rows_to_half does,
// for each row a of gate and up ([rows, width]); the row's weight is
// weights[(a / per) * stride + a % per + offset] (routed assignments: per = top_k, stride =
// top_k + 1, offset 0; the shared expert: per = 1, offset = top_k). One block of 256 threads per
// row; width a multiple of 8; permuted for `bits`-bit weights.
extern "C" __global__ void __launch_bounds__(256) swiglu_to_half(const float* gate, const float* up,
                                                                const float* weights, int per, int stride, int offset,
                                                                int width, int bits, __half* act16, float* actscale) {
    __shared__ float scratch[64];
    wait_for_previous_kernel();
    const size_t a = blockIdx.x;
    const float wa = weights[(a / per) * stride + a % per + offset];
    float mx = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x)
        mx = fmaxf(mx, fabsf(silu(gate[a * width + i]) * up[a * width + i] * wa));
    mx = block_sum_max(make_float2(0.0f, mx), scratch).y;
    const float s = mx > 0.0f ? exp2f(ceilf(log2f(mx)) - 14.0f) : 1.0f;
    const float r = wa / s;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const int src = permuted_input(i, bits);
        act16[a * width + i] = __float2half_rn(silu(gate[a * width + src]) * up[a * width + src] * r);
    }
    if (threadIdx.x == 0) actscale[a] = s;
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

// The tensor-core rate this GPU sustains for the mma.sync m16n8k16 fp16 products the prefill
// kernels use: each warp runs `iters` rounds of 8 independent products on registers (no memory
// traffic). The sum goes to out only if it equals an impossible value, so the compiler keeps the
// work. Grid: any, 256 threads.
extern "C" __global__ void __launch_bounds__(256) mma_peak(int iters, float* out) {
    const uint32_t a = 0x3c003c00u ^ threadIdx.x, b = 0x38003800u ^ blockIdx.x;
    float acc[8][4] = {};
    for (int i = 0; i < iters; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) mma_f16_16816(acc[j], a, a ^ j, b, a, b ^ i, b);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) sum += acc[j][0] + acc[j][1] + acc[j][2] + acc[j][3];
    if (sum == -1.2345e-30f) out[threadIdx.x] = sum;
}

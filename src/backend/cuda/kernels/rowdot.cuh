// Weight-row dot products shared by every kernel that multiplies by a weight matrix.
//
// A block first stages its input vector x in shared memory (RMS-normalised on the way when the
// kernel fuses a norm), then each warp computes several rows at once: every lane issues all of
// its 16-byte weight loads for those rows before using any, so enough bytes are in flight to
// keep HBM busy.
//
// Decode reads every weight once per token, so the arithmetic per weight must stay well under
// the rate HBM delivers them: at 3.5 TB/s of 4-bit weights an SM receives ~27 values per cycle
// and issues 4 warp instructions (128 lanes). A dependent mat-vec whose dot products were free
// (loads only) ran twice as fast on the H200 as one dotting in half2 at 1.6 instructions per
// value, so 4-bit rows are dotted in integers: x is staged as int16 with one f32 scale per
// 32-value chunk (the 16 bytes of a row one lane loads), and a 32-bit word of weights (8
// nibbles) costs two masks, one shift and four dp2a (two 16-bit inputs times two 8-bit weights
// each): 0.9 instructions per value, summed exactly in int32 (|sum| < 32 * 15 * 32767). The
// chunk's result is scale_w * xscale * sum(q * xq) + bias_w * csum. 8-bit rows are dotted the
// same way over 16-value chunks: a word of 4 bytes is two dp2a with no masking at all (0.5
// instructions per value, |sum| < 16 * 255 * 32767), where converting each byte to a float and
// multiplying it took ~3 and held the 8-bit products at about half the copy rate.
//
// Rounding x to 32767 levels of its chunk's largest magnitude costs at most 2^-16 of that
// magnitude per value and the sums are exact, where the half2 dot this replaced rounded every
// partial sum to fp16 (2^-11 relative of sums up to 3840). 8-bit inputs were faster still but
// 4x the bf16 rounding spread of the test fixtures.
//
// Staged layouts (a chunk is the 16 bytes of a row one lane loads; it covers vpc = 128 / bits
// inputs; `chunks` = cols / vpc):
//   4-bit: 16-byte entry k * chunks + c (word k = 0..3 of chunk c, inputs i = 32c + 8k + j) holds
//          the int16 pairs (x[i], x[i+2]), (x[i+4], x[i+6]), (x[i+1], x[i+3]), (x[i+5], x[i+7]);
//          then per chunk the float2 (xscale, csum).
//   8-bit: 16-byte entry h * chunks + c (h = 0, 1: inputs i = 16c + 8h + j) holds the int16 pairs
//          (x[i], x[i+1]), (x[i+2], x[i+3]), (x[i+4], x[i+5]), (x[i+6], x[i+7]); then per chunk
//          the float2 (xscale, csum).
//   bf16:  float4 k * chunks + c (k = 0..1) holds x[8c + 4k .. 8c + 4k + 3].
// The 32 lanes of a warp work on 32 consecutive chunks and so read 32 consecutive 16-byte
// entries: no bank conflicts.
//
// A quantised chunk contributes scale * sum(q * x) + bias * csum, csum the f32 sum of its x.

#include <cuda_fp16.h>

// Floats of shared memory a staged input of `cols` values needs (the largest layout: f32 x, chunk
// sums, the scale), rounded to whole float4s.
__host__ __device__ __forceinline__ int staged_floats(int cols) { return cols + ((cols / 8 + 4 + 3) & ~3); }

__device__ __forceinline__ uint32_t shared_address(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Copies 16 bytes from global memory to shared address dst asynchronously; writes zeros instead
// (reading nothing) when !valid.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid = true) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

// Copies the first `bytes` (0 to 16) of 16 from global memory to shared address dst
// asynchronously, zeros in the rest; through L2 only, as cp_async_16.
__device__ __forceinline__ void cp_async_16_part(uint32_t dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most PENDING of this thread's committed groups of copies are in flight (other
// threads' copies need a __syncthreads after).
template <int PENDING> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

__device__ __forceinline__ uint4 lds128(uint32_t address) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(address));
    return v;
}

__device__ __forceinline__ float2 lds64(uint32_t address) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(address));
    return v;
}

__device__ __forceinline__ __half2 as_half2(uint32_t u) { return *reinterpret_cast<const __half2*>(&u); }

// (a & mask) | bits in one LOP3 (the compiler emits two when both constants are immediates).
__device__ __forceinline__ uint32_t mask_or(uint32_t a, uint32_t mask, uint32_t bits) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));
    return d;
}

// The eight floats at p (32-byte aligned).
__device__ __forceinline__ void load_eight(const float* p, float (&v)[8]) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// An input vector being staged: `segments` pieces of `seg_cols` values each, piece p read from
// x[p] (x[0] + p * seg_stride when x is a single pointer) and multiplied by mult[p]. One piece for
// a plain mat-vec; the routed experts' activations, weighted, for moe_down.
struct StageSource {
    const float* x;
    int seg_stride;
    int seg_cols;
    int segments;
    const float* mult;  // null: 1 for every piece
};

// Sum of .x and max of .y over the block; every thread gets the result. `scratch`: 64 floats.
__device__ __forceinline__ float2 block_sum_max(float2 v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v.x = warp_sum(v.x);
    v.y = warp_max(v.y);
    __syncthreads();
    if (lane == 0) { scratch[warp] = v.x; scratch[32 + warp] = v.y; }
    __syncthreads();
    return make_float2(warp_sum(lane < warps ? scratch[lane] : 0.0f), warp_max(lane < warps ? scratch[32 + lane] : 0.0f));
}

// Eight consecutive inputs of the source starting at flat index i (a multiple of 8), times
// norm_scale and the piece's multiplier; their squares (before either) are added to ss.
__device__ __forceinline__ void source_eight(const StageSource& src, const float* norm_scale, int i, float (&e)[8],
                                             float& ss) {
    const int p = src.segments == 1 ? 0 : div_fast(i, src.seg_cols), o = i - p * src.seg_cols;
    const float4* x4 = reinterpret_cast<const float4*>(src.x + (size_t)p * src.seg_stride + o);
    const float m = src.mult != nullptr ? src.mult[p] : 1.0f;
    const float4 a = x4[0], b = x4[1];
    ss += (a.x * a.x + a.y * a.y) + (a.z * a.z + a.w * a.w) + (b.x * b.x + b.y * b.y) + (b.z * b.z + b.w * b.w);
    float4 na = make_float4(1.0f, 1.0f, 1.0f, 1.0f), nb = na;
    if (norm_scale != nullptr) {
        na = reinterpret_cast<const float4*>(norm_scale + o)[0];
        nb = reinterpret_cast<const float4*>(norm_scale + o)[1];
    }
    e[0] = a.x * na.x * m; e[1] = a.y * na.y * m; e[2] = a.z * na.z * m; e[3] = a.w * na.w * m;
    e[4] = b.x * nb.x * m; e[5] = b.y * nb.y * m; e[6] = b.z * nb.z * m; e[7] = b.w * nb.w * m;
}

// Stores word t (inputs 8t .. 8t + 7, their values e) of a staged input of `cols` values into
// xs, in the layout above. Called by whole warps, consecutive words on consecutive lanes: a
// quantised chunk's scale and sum are shuffled over its words (four of a 4-bit chunk, two of an
// 8-bit one). Lanes past the input (valid false) take part in the shuffles with zeros and store
// nothing.
template <int BITS>
__device__ __forceinline__ void stage_word(int t, bool valid, int cols, const float (&e)[8], float* xs) {
    if (BITS == 4 || BITS == 8) {
        constexpr int WORDS = BITS == 4 ? 4 : 2;  // words of 8 inputs per chunk
        const int chunks = cols / (8 * WORDS);
        float2* chunk_stats = reinterpret_cast<float2*>(xs + cols / 2);
        // t >= 0: unsigned, so that the division by the power of two is a plain shift.
        const int c = (unsigned)t / WORDS, k = (unsigned)t % WORDS;
        float sum = ((e[0] + e[1]) + (e[2] + e[3])) + ((e[4] + e[5]) + (e[6] + e[7]));
        float mx = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fabsf(e[j]));
#pragma unroll
        for (int o = 1; o < WORDS; o <<= 1) {
            sum += __shfl_xor_sync(0xffffffffu, sum, o);
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        }
        const float to_int = mx > 0.0f ? 32767.0f / mx : 0.0f;
        uint32_t q[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) q[j] = static_cast<uint32_t>(__float2int_rn(e[j] * to_int)) & 0xffffu;
        if (valid) {
            reinterpret_cast<uint4*>(xs)[k * chunks + c] =
                BITS == 4 ? make_uint4(q[0] | q[2] << 16, q[4] | q[6] << 16, q[1] | q[3] << 16, q[5] | q[7] << 16)
                          : make_uint4(q[0] | q[1] << 16, q[2] | q[3] << 16, q[4] | q[5] << 16, q[6] | q[7] << 16);
            if (k == 0) chunk_stats[c] = make_float2(mx * (1.0f / 32767.0f), sum);
        }
    } else {
        const int chunks = cols / 8;
        // Word t is chunk t: float4s 0 and 1 of it.
        if (valid) {
            float4* x4 = reinterpret_cast<float4*>(xs);
            x4[t] = make_float4(e[0], e[1], e[2], e[3]);
            x4[chunks + t] = make_float4(e[4], e[5], e[6], e[7]);
        }
    }
}

// The end of stage() and stage_held(): the staging threads' sums of squares `ss`, added warp by
// warp in order, a barrier for the whole block, then the norm's 1 / rms (1 without a norm).
template <int THREADS>
__device__ __forceinline__ float staged_scale(bool stages, float ss, const float* norm_scale, int cols, float eps,
                                              float* scratch) {
    const int warps = (THREADS == 0 ? blockDim.x : THREADS) >> 5;
    if (norm_scale != nullptr && stages) {
        ss = warp_sum(ss);
        if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = ss;
    }
    __syncthreads();
    if (norm_scale == nullptr) return 1.0f;
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) total += scratch[w];
    return rsqrtf(total / cols + eps);
}

// Stages the source for a weight of BITS bits into xs (16-byte aligned), then a barrier; scaled
// by norm_scale when non-null, and returns the factor every product with the staged input must
// then be multiplied by: the RMS norm's 1 / rms(x) (norm over a single piece only), else 1.
// Applying the norm after the products (they are linear in x) lets one pass over x both stage
// it and sum its squares. scratch: 64 floats. Every thread takes whole 8-value words, so chunk
// sums need no second pass.
//
// THREADS (a multiple of 32, 0 for the whole block): stage by the block's first THREADS threads
// only, bit for bit what a block of that many threads stages (the norm's sum of squares depends
// on how the words are spread over the threads); every thread of the block still reaches the
// barrier. A template parameter, so that the whole-block form compiles as it did before the
// option existed.
template <int BITS, int THREADS = 0>
__device__ float stage(const StageSource& src, const float* norm_scale, float eps, float* xs, float* scratch) {
    // Spelled as the whole-block form was before THREADS existed (blockDim.x unsigned), which
    // the compiler then turns into the same code: other spellings cost the bf16 MoE kernels up
    // to 24 registers.
    const bool stages = THREADS == 0 || threadIdx.x < THREADS;
    const int cols = src.seg_cols * src.segments;
    float ss = 0.0f;
    const int words = cols / 8;
    // Warp-uniform trip count: stage_word's shuffles need every lane.
    if (stages)
        for (int t = threadIdx.x; t < ((words + 31) & ~31); t += (THREADS == 0 ? blockDim.x : THREADS)) {
            float e[8] = {};
            if (t < words) source_eight(src, norm_scale, 8 * t, e, ss);
            stage_word<BITS>(t, t < words, cols, e, xs);
        }
    return staged_scale<THREADS>(stages, ss, norm_scale, cols, eps, scratch);
}

// stage() in two halves, where no staging thread has more than W 8-value words of the input
// (stage_holds): stage_hold loads this thread's words (norm applied, squares summed) into
// registers, stage_held stores them, then synchronises and returns the scale as stage() does. Bit
// for bit stage<BITS, THREADS>, but a block can take the input's L2 round trip early and leave the
// staging itself (shuffles, stores, a barrier) until after other work.
template <int W = 1>
struct HeldWords {
    float e[W][8];
    float ss;
};

template <int THREADS, int W = 1>
__device__ __forceinline__ bool stage_holds(const StageSource& src) {
    const int words = src.seg_cols * src.segments / 8;
    return ((words + 31) & ~31) <= W * (THREADS == 0 ? (int)blockDim.x : THREADS);
}

// Word k of this thread is stage()'s k-th trip: word threadIdx.x + k * (the staging threads).
template <int THREADS, int W = 1>
__device__ __forceinline__ void stage_hold(const StageSource& src, const float* norm_scale, HeldWords<W>& h) {
    const int words = src.seg_cols * src.segments / 8, stride = THREADS == 0 ? (int)blockDim.x : THREADS;
    h.ss = 0.0f;
#pragma unroll
    for (int k = 0; k < W; ++k) {
#pragma unroll
        for (int j = 0; j < 8; ++j) h.e[k][j] = 0.0f;
        const int t = threadIdx.x + k * stride;
        if ((THREADS == 0 || threadIdx.x < THREADS) && t < words) source_eight(src, norm_scale, 8 * t, h.e[k], h.ss);
    }
}

template <int BITS, int THREADS, int W = 1>
__device__ float stage_held(const StageSource& src, const float* norm_scale, float eps, const HeldWords<W>& h,
                            float* xs, float* scratch) {
    const bool stages = THREADS == 0 || threadIdx.x < THREADS;
    const int cols = src.seg_cols * src.segments, words = cols / 8;
    const int stride = THREADS == 0 ? (int)blockDim.x : THREADS;
    // stage()'s loop, which runs at most W times per thread here (whole warps: stage_word shuffles).
#pragma unroll
    for (int k = 0; k < W; ++k) {
        const int t = threadIdx.x + k * stride;
        if (stages && t < ((words + 31) & ~31)) stage_word<BITS>(t, t < words, cols, h.e[k], xs);
    }
    return staged_scale<THREADS>(stages, h.ss, norm_scale, cols, eps, scratch);
}

// stage() by one warp, so that the warps of a block stage several inputs at once (no barrier: the
// caller synchronises). Bit for bit what stage() gives in a block of WARPS warps: lane l sums the
// squares of the words thread v * 32 + l of that block would, in the same order, for each warp v,
// and the warps' sums are added in order. A lane requests 4 words before it uses any: as many
// loads in flight as fit in registers beside the callers' weight rows.
template <int BITS, int WARPS>
__device__ float stage_by_warp(const StageSource& src, const float* norm_scale, float eps, float* xs) {
    constexpr int G = 4;
    static_assert(WARPS % G == 0, "whole groups of words");
    const int lane = threadIdx.x & 31;
    const int cols = src.seg_cols * src.segments, words = cols / 8;
    float ss[WARPS];
#pragma unroll
    for (int v = 0; v < WARPS; ++v) ss[v] = 0.0f;
    for (int base = 0; base < words; base += 32 * WARPS) {
#pragma unroll
        for (int v0 = 0; v0 < WARPS; v0 += G) {
            float e[G][8];
#pragma unroll
            for (int v = 0; v < G; ++v) {
                const int t = base + (v0 + v) * 32 + lane;
#pragma unroll
                for (int j = 0; j < 8; ++j) e[v][j] = 0.0f;
                if (t < words) source_eight(src, norm_scale, 8 * t, e[v], ss[v0 + v]);
            }
#pragma unroll
            for (int v = 0; v < G; ++v) {
                const int t = base + (v0 + v) * 32 + lane;
                stage_word<BITS>(t, t < words, cols, e[v], xs);
            }
        }
    }
    if (norm_scale == nullptr) return 1.0f;
    float total = 0.0f;
#pragma unroll
    for (int v = 0; v < WARPS; ++v) total += warp_sum(ss[v]);
    return rsqrtf(total / cols + eps);
}

// Floats of shared memory a staged input of `cols` values takes for BITS-bit weights (the layout
// above), rounded to whole float4s: what several staged inputs side by side each take.
__host__ __device__ __forceinline__ int staged_floats_bits(int cols, int bits) {
    const int floats = bits == 4 ? cols / 2 + cols / 16 : bits == 8 ? cols / 2 + cols / 8 : cols;
    return (floats + 3) & ~3;
}

// The staged input as the dot products read it.
struct StagedX {
    uint32_t x;     // shared address of the entries
    uint32_t csum;  // shared address of the chunks' (xscale, csum) pairs (quantised weights)
    int chunks;
};

template <int BITS>
__device__ __forceinline__ StagedX staged_x(const float* xs, int cols) {
    StagedX v;
    v.x = shared_address(xs);
    v.chunks = cols / (128 / BITS);
    v.csum = shared_address(xs + cols / 2);
    return v;
}

// A 16-byte load of weights, which every decode step streams once: marked first to evict from
// L2 so that they do not push out what is reused (activations, caches, recurrent state, code).
__device__ __forceinline__ uint4 load_weights(const uint4* p) {
    uint4 v;
    asm volatile(
        "{\n\t.reg .b64 policy;\n\t"
        "createpolicy.fractional.L2::evict_first.b64 policy, 1.0;\n\t"
        "ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], policy;\n\t}"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// One weight row: its 16-byte chunks and, when quantised, one scale and bias per group.
struct RowRef {
    const uint4* data;  // null: no row (its result is 0)
    const scale_t* scales;
    const scale_t* biases;
};

__device__ __forceinline__ RowRef row_ref(const Weight& w, int row) {
    RowRef r;
    if (row < 0 || row >= w.rows) {
        r.data = nullptr;
        r.scales = r.biases = nullptr;
        return r;
    }
    // cols * bits / 128: a division by the run-time width would cost ~20 instructions per row.
    const int chunks = (w.cols * w.bits) >> 7;
    r.data = reinterpret_cast<const uint4*>(static_cast<const char*>(w.data) + (size_t)row * chunks * 16);
    const size_t groups = w.bits == 16 ? 0 : (size_t)(w.cols >> w.group_shift);
    r.scales = w.scales + row * groups;
    r.biases = w.biases + row * groups;
    return r;
}

// The loads of one pass over R rows: U chunks per lane per row, with their scales and biases.
template <int R, int U>
struct Pass {
    uint4 u[R][U];
    scale_t scale[R][U];
    scale_t bias[R][U];
};

// Issues the loads of the pass starting at chunk `base` of rows with `chunks` chunks (nothing
// is waited for here).
template <int BITS, int R, int U>
__device__ __forceinline__ void load_pass(const RowRef (&rows)[R], int base, int chunks, int group_shift, int lane,
                                          Pass<R, U>& p) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const int c = base + j * 32 + lane;
            const bool valid = rows[i].data != nullptr && c < chunks;
            p.u[i][j] = valid ? load_weights(rows[i].data + c) : make_uint4(0, 0, 0, 0);
            if (BITS != 16) {
                const int g = (c * (128 / BITS)) >> group_shift;
                p.scale[i][j] = valid ? rows[i].scales[g] : scale_zero();
                p.bias[i][j] = valid ? rows[i].biases[g] : scale_zero();
            }
        }
}

// sum(q * xq) over one 4-bit word's 8 values, x its staged entry (see stage), added to acc: the
// even nibbles masked in place are four bytes, the odd ones after a shift by 4, and each dp2a
// multiplies two of them by two 16-bit inputs.
__device__ __forceinline__ int word_dot4(uint32_t w, uint4 x, int acc) {
    const int even = static_cast<int>(w & 0x0F0F0F0Fu), odd = static_cast<int>((w >> 4) & 0x0F0F0F0Fu);
    acc = __dp2a_lo(static_cast<int>(x.x), even, acc);
    acc = __dp2a_hi(static_cast<int>(x.y), even, acc);
    acc = __dp2a_lo(static_cast<int>(x.z), odd, acc);
    return __dp2a_hi(static_cast<int>(x.w), odd, acc);
}

// sum(q * xq) over one 8-bit word's 4 values (bytes 0..3, unsigned) against the int16 pairs
// (x0, x1) in lo and (x2, x3) in hi, added to acc.
__device__ __forceinline__ int word_dot8(uint32_t w, uint32_t lo, uint32_t hi, int acc) {
    asm("dp2a.lo.s32.u32 %0, %1, %2, %0;" : "+r"(acc) : "r"(lo), "r"(w));
    asm("dp2a.hi.s32.u32 %0, %1, %2, %0;" : "+r"(acc) : "r"(hi), "r"(w));
    return acc;
}

// The staged entries of chunk c: 4 / 2 / 2 16-byte entries for 4-bit / 8-bit / bf16 weights.
template <int BITS>
__device__ __forceinline__ void load_x(const StagedX& sx, int c, uint4 (&xv)[4]) {
    constexpr int N = BITS == 4 ? 4 : 2;
#pragma unroll
    for (int k = 0; k < N; ++k) xv[k] = lds128(sx.x + (uint32_t)(k * sx.chunks + c) * 16u);
}

__device__ __forceinline__ float4 as_float4(uint4 v) {
    return make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w));
}

// Adds one chunk (its 16 bytes in u) dotted with its staged entries xv to acc; `stats` is the
// chunk's (xscale, csum) for quantised weights.
template <int BITS>
__device__ __forceinline__ void chunk_dot(uint4 u, const uint4 (&xv)[4], float2 stats, scale_t scale_b, scale_t bias_b,
                                          float& acc) {
    if (BITS == 4 || BITS == 8) {
        int q;
        if (BITS == 4) {
            q = word_dot4(u.x, xv[0], 0);
            q = word_dot4(u.y, xv[1], q);
            q = word_dot4(u.z, xv[2], q);
            q = word_dot4(u.w, xv[3], q);
        } else {
            q = word_dot8(u.x, xv[0].x, xv[0].y, 0);
            q = word_dot8(u.y, xv[0].z, xv[0].w, q);
            q = word_dot8(u.z, xv[1].x, xv[1].y, q);
            q = word_dot8(u.w, xv[1].z, xv[1].w, q);
        }
        acc = fmaf(scale_f32(scale_b) * stats.x, static_cast<float>(q), acc);
        acc = fmaf(scale_f32(bias_b), stats.y, acc);
    } else {
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const float4 x = as_float4(xv[k]);
            acc += x.x * __uint_as_float(w[2 * k] << 16) + x.y * __uint_as_float(w[2 * k] & 0xffff0000u) +
                  x.z * __uint_as_float(w[2 * k + 1] << 16) + x.w * __uint_as_float(w[2 * k + 1] & 0xffff0000u);
        }
    }
}

// This lane's share of R rows' dot products with one staged x (a warp_sum completes each).
template <int R>
struct RowSums {
    float total[R];
    __device__ __forceinline__ void clear() {
#pragma unroll
        for (int i = 0; i < R; ++i) total[i] = 0.0f;
    }
};

// Adds the pass loaded in p (chunks from `base`) to the rows' sums; every row multiplies the same
// staged x, read once per chunk.
template <int BITS, int R, int U>
__device__ __forceinline__ void use_pass(const RowRef (&rows)[R], const StagedX& sx, int base, int lane,
                                         const Pass<R, U>& p, RowSums<R>& acc) {
    uint4 xv[4];
#pragma unroll
    for (int j = 0; j < U; ++j) {
        const int c = base + j * 32 + lane;
        if (c >= sx.chunks) continue;
        load_x<BITS>(sx, c, xv);
        const float2 stats = BITS == 16 ? make_float2(0.0f, 0.0f) : lds64(sx.csum + 8u * c);
#pragma unroll
        for (int i = 0; i < R; ++i) {
            if (rows[i].data == nullptr) continue;
            chunk_dot<BITS>(p.u[i][j], xv, stats, p.scale[i][j], p.bias[i][j], acc.total[i]);
        }
    }
}

// Adds the rows' dot products with the staged x, given the first pass already loaded in p (see
// load_pass).
template <int BITS, int R, int U>
__device__ __forceinline__ void dot_rows(const RowRef (&rows)[R], const StagedX& sx, int group_shift, int lane,
                                         Pass<R, U>& p, RowSums<R>& acc) {
    for (int base = 0;;) {
        use_pass<BITS, R, U>(rows, sx, base, lane, p, acc);
        base += 32 * U;
        if (base >= sx.chunks) break;
        load_pass<BITS, R, U>(rows, base, sx.chunks, group_shift, lane, p);
    }
}

// Words of x per thread up to which matvec_impl requests x before its first rows (0: never).
#ifndef MATVEC_X_WORDS
#define MATVEC_X_WORDS 1
#endif
// The grid's first blocks, in the order they are placed (x fastest, then y, then z), up to this
// number keep the weights-first order where x could be read first: the backend sets it to the
// GPU's SM count (0 here, for `kernels --check`, which has no GPU).
#ifndef MATVEC_WARM_BLOCKS
#define MATVEC_WARM_BLOCKS 0
#endif
__device__ __forceinline__ bool placed_beside_previous_kernel() {
    const unsigned placed = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    return placed < MATVEC_WARM_BLOCKS;
}

// y = W x (y = add + W x when `add` is non-null, which may be y itself; x RMS-normalised by
// norm_scale when non-null) by `blocks` blocks of the grid, this one block number `block` of
// them, persistent over the rows. Each warp computes R rows at a time, U 16-byte chunks of each
// per lane per pass: R = 4, U = 2 for tall matrices; R = 1, U = 4 for short ones, which then
// spread over more blocks.
template <int BITS, int R, int U>
__device__ void matvec_impl(const Weight& w, const float* x, const float* norm_scale, float eps, float* y,
                            const float* add, float* smem, int block, int blocks) {
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int chunks = w.cols / values_per_chunk(BITS);
    const int stride = blocks * warps * R;
    float* xs = smem + 64;
    int row0 = (block * warps + (threadIdx.x >> 5)) * R;
    RowRef rows[R];
    Pass<R, U> pass;
#pragma unroll
    for (int i = 0; i < R; ++i) rows[i] = row_ref(w, row0 + i);
    const StageSource src = {x, 0, w.cols, 1, nullptr};
    // Where every thread holds at most MATVEC_X_WORDS words of x, x's L2 read is requested right
    // after the wait and the first rows' weights just after it; otherwise the weights are
    // requested before the wait. A block placed only as the previous kernel's blocks leave (most
    // of in_proj's and qkv's) passes its wait at once, and an L2 read requested behind an SM's
    // weight requests returns only after their bytes (scripts/microbench/stream_chain.cu): x
    // first, its staging overlaps the weights' arrival instead of following it (+1.35% on an H100).
    // But a grid's blocks are placed in order, so its first ones, one per SM, are those placed
    // beside the previous kernel's blocks, whose wait does not pass at once: they keep the
    // weights-first order, and have their first rows on the way while they wait (+1.2% on an H100).
    constexpr int XW = MATVEC_X_WORDS > 0 ? MATVEC_X_WORDS : 1;
    const bool x_first = MATVEC_X_WORDS > 0 && !placed_beside_previous_kernel() && stage_holds<0, XW>(src);
    // The first rows of `add` are read before the wait (the caller guarantees the launch just
    // before did not write it).
    if (!x_first) load_pass<BITS, R, U>(rows, 0, chunks, w.group_shift, lane, pass);
    float prior[R];
#pragma unroll
    for (int i = 0; i < R; ++i) prior[i] = add != nullptr && lane == 0 && row0 + i < w.rows ? add[row0 + i] : 0.0f;
    const int first_row0 = row0;
    wait_for_previous_kernel();
    float x_scale;
    if (x_first) {
        HeldWords<XW> held;
        stage_hold<0>(src, norm_scale, held);
        load_pass<BITS, R, U>(rows, 0, chunks, w.group_shift, lane, pass);
        x_scale = stage_held<BITS, 0>(src, norm_scale, eps, held, xs, smem);
    } else {
        x_scale = stage<BITS>(src, norm_scale, eps, xs, smem);
    }
    const StagedX sx = staged_x<BITS>(xs, w.cols);
    while (row0 < w.rows) {
        RowSums<R> acc;
        acc.clear();
        dot_rows<BITS, R, U>(rows, sx, w.group_shift, lane, pass, acc);
        const int next = row0 + stride;
        RowRef next_rows[R];
#pragma unroll
        for (int i = 0; i < R; ++i) next_rows[i] = row_ref(w, next + i);
        if (next < w.rows) load_pass<BITS, R, U>(next_rows, 0, chunks, w.group_shift, lane, pass);
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const float v = warp_sum(acc.total[i]) * x_scale;
            const int row = row0 + i;
            if (lane == 0 && row < w.rows) y[row] = add != nullptr ? (row0 == first_row0 ? prior[i] : add[row]) + v : v;
            rows[i] = next_rows[i];
        }
        row0 = next;
    }
}

// A few tokens at once (T at most, `tokens` of them): every weight row is read once and dotted
// with each token's staged x in turn, in the order the one-token kernel dots it, so each token's
// result is bit for bit what matvec_impl gives it alone. Token t's x and y (and add) rows are
// w.cols and w.rows floats after token t - 1's. Shared memory: T * R floats per warp, then per token of the
// block 64 + staged_floats(cols).
template <int BITS, int R, int U, int T>
__device__ void matvec_tokens_impl(const Weight& w, const float* x, const float* norm_scale, float eps, float* y,
                                   const float* add, int tokens, float* smem) {
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int chunks = w.cols / values_per_chunk(BITS);
    const int stride = gridDim.x * warps * R;
    const int per_token = 64 + staged_floats(w.cols);
    int row0 = (blockIdx.x * warps + (threadIdx.x >> 5)) * R;
    RowRef rows[R];
    Pass<R, U> pass;
#pragma unroll
    for (int i = 0; i < R; ++i) rows[i] = row_ref(w, row0 + i);
    load_pass<BITS, R, U>(rows, 0, chunks, w.group_shift, lane, pass);
    // The first rows of y when accumulating, read before the wait (as matvec_impl), kept in
    // shared memory (registers are what hold the weights in flight): T * R floats per warp,
    // before the stagings.
    float* prior = smem + (threadIdx.x >> 5) * T * R;
    smem += warps * T * R;
    if (lane == 0) {
#pragma unroll
        for (int t = 0; t < T; ++t)
#pragma unroll
            for (int i = 0; i < R; ++i)
                prior[t * R + i] =
                    add != nullptr && t < tokens && row0 + i < w.rows ? add[(size_t)t * w.rows + row0 + i] : 0.0f;
    }
    const int first_row0 = row0;
    wait_for_previous_kernel();
    float x_scale[T];
#pragma unroll
    for (int t = 0; t < T; ++t) {
        // Each token's own reduction scratch: the stagings follow each other without a barrier.
        float* scratch = smem + t * per_token;
        const StageSource src = {x + (size_t)t * w.cols, 0, w.cols, 1, nullptr};
        x_scale[t] = t < tokens ? stage<BITS>(src, norm_scale, eps, scratch + 64, scratch) : 0.0f;
    }
    while (row0 < w.rows) {
        RowSums<R> acc[T];
#pragma unroll
        for (int t = 0; t < T; ++t) acc[t].clear();
        for (int base = 0;;) {
#pragma unroll
            for (int t = 0; t < T; ++t)
                if (t < tokens)
                    use_pass<BITS, R, U>(rows, staged_x<BITS>(smem + t * per_token + 64, w.cols), base, lane, pass,
                                         acc[t]);
            base += 32 * U;
            if (base >= chunks) break;
            load_pass<BITS, R, U>(rows, base, chunks, w.group_shift, lane, pass);
        }
        const int next = row0 + stride;
        RowRef next_rows[R];
#pragma unroll
        for (int i = 0; i < R; ++i) next_rows[i] = row_ref(w, next + i);
        if (next < w.rows) load_pass<BITS, R, U>(next_rows, 0, chunks, w.group_shift, lane, pass);
#pragma unroll
        for (int t = 0; t < T; ++t) {
#pragma unroll
            for (int i = 0; i < R; ++i) {
                const float v = warp_sum(acc[t].total[i]) * x_scale[t];
                const int row = row0 + i;
                float* out = y + (size_t)t * w.rows + row;
                if (t < tokens && lane == 0 && row < w.rows)
                    *out = add != nullptr ? (row0 == first_row0 ? prior[t * R + i] : add[out - y]) + v : v;
            }
        }
#pragma unroll
        for (int i = 0; i < R; ++i) rows[i] = next_rows[i];
        row0 = next;
    }
}

template <int R, int U, int T>
__device__ void matvec_tokens_bits(const Weight& w, const float* x, const float* norm_scale, float eps, float* y,
                                   const float* add, int tokens, float* smem) {
    switch (w.bits) {
        case 4: matvec_tokens_impl<4, R, U, T>(w, x, norm_scale, eps, y, add, tokens, smem); break;
        case 8: matvec_tokens_impl<8, R, U, T>(w, x, norm_scale, eps, y, add, tokens, smem); break;
        default: matvec_tokens_impl<16, R, U, T>(w, x, norm_scale, eps, y, add, tokens, smem); break;
    }
}

template <int R, int U>
__device__ void matvec_bits(const Weight& w, const float* x, const float* norm_scale, float eps, float* y,
                            const float* add, float* smem, int block, int blocks) {
    switch (w.bits) {
        case 4: matvec_impl<4, R, U>(w, x, norm_scale, eps, y, add, smem, block, blocks); break;
        case 8: matvec_impl<8, R, U>(w, x, norm_scale, eps, y, add, smem, block, blocks); break;
        default: matvec_impl<16, R, U>(w, x, norm_scale, eps, y, add, smem, block, blocks); break;
    }
}

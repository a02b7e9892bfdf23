// Weight-row dot products shared by every kernel that multiplies by a weight matrix.
//
// A block first stages its input vector x in shared memory (RMS-normalised on the way when the
// kernel fuses a norm), then each warp computes several rows at once: every lane issues all of
// its 16-byte weight loads for those rows before using any, so enough bytes are in flight to
// keep HBM busy.
//
// Staged layout: a 16-byte chunk of a row covers `vpc = 128 / bits` consecutive inputs. Input i
// (chunk c = i / vpc, offset j = i % vpc) is stored as component j % 4 of float4 number
// (j / 4) * chunks + c, so the 32 lanes of a warp, which work on 32 consecutive chunks, read 32
// consecutive float4s: no bank conflicts. For quantised weights `csum[c]` holds the sum of x over
// chunk c.
//
// Dequantisation without integer-to-float conversions: OR-ing a value q that sits at bit p of a
// word (p + bits <= 23, its other bits masked off) into the bits of 1.0f gives exactly
// 1 + q * 2^(p - 23); subtracting 1 leaves q * 2^(p - 23). Products are summed per bit position
// and scaled back by 2^(23 - p) once per chunk, so a chunk costs one mask, one add and one FMA per
// value. A chunk then contributes scale * sum(q * x) + bias * csum.

// Floats of shared memory a staged input of `cols` values needs (x, then chunk sums), rounded
// to whole float4s.
__host__ __device__ __forceinline__ int staged_floats(int cols) { return cols + ((cols / 8 + 3) & ~3); }

// Writes x (times `inv` and `norm_scale` when non-null) in the staged layout for a weight of
// `bits` bits and `cols` inputs into `xs` (16-byte aligned). x and norm_scale are read as float4s
// (16-byte aligned, cols a multiple of 8), several loads in flight per thread: staging sits on
// every mat-vec's critical path. No barrier: see stage_chunk_sums.
__device__ __forceinline__ void stage_values(int bits, int cols, const float* x, const float* norm_scale, float inv,
                                             float* xs) {
    const int vpc = values_per_chunk(bits);
    const int chunks = cols / vpc;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const float4* n4 = reinterpret_cast<const float4*>(norm_scale);
#pragma unroll 4
    for (int i4 = threadIdx.x; i4 < cols / 4; i4 += blockDim.x) {
        const float4 v = x4[i4];
        const float4 n = norm_scale != nullptr ? n4[i4] : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
        const float e[4] = {v.x * inv * n.x, v.y * inv * n.y, v.z * inv * n.z, v.w * inv * n.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = 4 * i4 + k;
            const int c = i / vpc, j = i % vpc;
            xs[((j >> 2) * chunks + c) * 4 + (j & 3)] = e[k];
        }
    }
}

// This thread's share of sum(x[i]^2), read as float4s (see stage_values).
__device__ __forceinline__ float sum_of_squares(const float* x, int cols) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float ss = 0.0f;
#pragma unroll 4
    for (int i4 = threadIdx.x; i4 < cols / 4; i4 += blockDim.x) {
        const float4 v = x4[i4];
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    return ss;
}

// The chunk sums after staged values (quantised weights only), computed by threads
// [0, threads); call after a barrier that follows stage_values, and put a barrier before using
// them.
__device__ __forceinline__ void stage_chunk_sums(int bits, int cols, float* xs, int threads) {
    if (bits == 16) return;
    const int vpc = values_per_chunk(bits);
    const int chunks = cols / vpc;
    const float4* x4 = reinterpret_cast<const float4*>(xs);
    float* csum = xs + cols;
    for (int c = threadIdx.x; c < chunks; c += threads) {
        float s = 0.0f;
        for (int q = 0; q < vpc / 4; ++q) {
            const float4 f = x4[q * chunks + c];
            s += (f.x + f.y) + (f.z + f.w);
        }
        csum[c] = s;
    }
}

// Stages x (RMS-normalised and scaled by `norm_scale` when non-null) for a weight of `bits` bits
// and `cols` inputs into `xs` (16-byte aligned), chunk sums after it. `scratch` holds 32 floats.
__device__ void stage_input(int bits, int cols, const float* x, const float* norm_scale, float eps, float* xs,
                            float* scratch) {
    float inv = 1.0f;
    if (norm_scale != nullptr) inv = rsqrtf(block_sum(sum_of_squares(x, cols), scratch) / cols + eps);
    stage_values(bits, cols, x, norm_scale, inv, xs);
    __syncthreads();
    stage_chunk_sums(bits, cols, xs, blockDim.x);
    __syncthreads();
}

// One weight row and the staged input it multiplies.
struct RowRef {
    const uint4* data;  // null: no row (its result is 0)
    const bf16* scales;
    const bf16* biases;
    const float4* x;
    const float* csum;
    int chunks;
};

__device__ __forceinline__ RowRef row_ref(const Weight& w, int row, const float* xs) {
    RowRef r;
    const int vpc = values_per_chunk(w.bits);
    r.chunks = w.cols / vpc;
    r.x = reinterpret_cast<const float4*>(xs);
    r.csum = xs + w.cols;
    if (row < 0 || row >= w.rows) {
        r.data = nullptr;
        r.scales = r.biases = nullptr;
        return r;
    }
    r.data = reinterpret_cast<const uint4*>(static_cast<const char*>(w.data) + (size_t)row * r.chunks * 16);
    const size_t groups = w.bits == 16 ? 0 : (size_t)(w.cols / w.group);
    r.scales = w.scales + row * groups;
    r.biases = w.biases + row * groups;
    return r;
}

__device__ __forceinline__ float dot4(float4 x, float a, float b, float c, float d) {
    return x.x * a + x.y * b + x.z * c + x.w * d;
}

// q * 2^(P - 23) for the value at bits [P, P + BITS) of w (P + BITS <= 23).
template <int BITS, int P>
__device__ __forceinline__ float low_bits_f(uint32_t w) {
    return __uint_as_float((w & (((1u << BITS) - 1u) << P)) | 0x3F800000u) - 1.0f;
}

// The loads of one pass over R rows: U chunks per lane per row, with their scales and biases.
template <int R, int U>
struct Pass {
    uint4 u[R][U];
    float scale[R][U];
    float bias[R][U];
};

// Issues the loads of the pass starting at chunk `base` (nothing is waited for here).
template <int BITS, int R, int U>
__device__ __forceinline__ void load_pass(const RowRef (&rows)[R], int base, int group, int lane, Pass<R, U>& p) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const int c = base + j * 32 + lane;
            const bool valid = rows[i].data != nullptr && c < rows[i].chunks;
            p.u[i][j] = valid ? __ldg(rows[i].data + c) : make_uint4(0, 0, 0, 0);
            if (BITS != 16) {
                const int g = (c * (128 / BITS)) / group;
                p.scale[i][j] = valid ? __bfloat162float(rows[i].scales[g]) : 0.0f;
                p.bias[i][j] = valid ? __bfloat162float(rows[i].biases[g]) : 0.0f;
            }
        }
}

// The staged inputs of chunk c of a row: 8 / 4 / 2 float4s for 4-bit / 8-bit / bf16 weights.
template <int BITS>
__device__ __forceinline__ void load_x(const RowRef& r, int c, float4 (&xv)[8]) {
    constexpr int N = BITS == 4 ? 8 : BITS == 8 ? 4 : 2;
#pragma unroll
    for (int k = 0; k < N; ++k) xv[k] = r.x[k * r.chunks + c];
}

// One chunk (its 16 bytes in u) dotted with its staged inputs xv (csum: their sum).
template <int BITS>
__device__ __forceinline__ float chunk_dot(uint4 u, const float4 (&xv)[8], float csum, float scale, float bias) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
    if (BITS == 16) {
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < 2; ++k)
            s += dot4(xv[k], __uint_as_float(w[2 * k] << 16), __uint_as_float(w[2 * k] & 0xffff0000u),
                      __uint_as_float(w[2 * k + 1] << 16), __uint_as_float(w[2 * k + 1] & 0xffff0000u));
        return s;
    } else if (BITS == 4) {
        // Nibbles 0-4 in place (bits 0-19); nibbles 5-7 after a shift by 12 (bits 8-19).
        float a0 = 0.0f, a4 = 0.0f, a8 = 0.0f, a12 = 0.0f, a16 = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint32_t lo = w[k], hi = w[k] >> 12;
            const float4 x0 = xv[2 * k], x1 = xv[2 * k + 1];
            a0 += low_bits_f<4, 0>(lo) * x0.x;
            a4 += low_bits_f<4, 4>(lo) * x0.y;
            a8 += low_bits_f<4, 8>(lo) * x0.z;
            a12 += low_bits_f<4, 12>(lo) * x0.w;
            a16 += low_bits_f<4, 16>(lo) * x1.x;
            a8 += low_bits_f<4, 8>(hi) * x1.y;
            a12 += low_bits_f<4, 12>(hi) * x1.z;
            a16 += low_bits_f<4, 16>(hi) * x1.w;
        }
        const float q = a0 * 8388608.0f + a4 * 524288.0f + a8 * 32768.0f + a12 * 2048.0f + a16 * 128.0f;
        return scale * q + bias * csum;
    } else {
        // Bytes 0-1 in place (bits 0-15); bytes 2-3 after a shift by 16.
        float a0 = 0.0f, a8 = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint32_t lo = w[k], hi = w[k] >> 16;
            const float4 x = xv[k];
            a0 += low_bits_f<8, 0>(lo) * x.x;
            a8 += low_bits_f<8, 8>(lo) * x.y;
            a0 += low_bits_f<8, 0>(hi) * x.z;
            a8 += low_bits_f<8, 8>(hi) * x.w;
        }
        return scale * (a0 * 8388608.0f + a8 * 32768.0f) + bias * csum;
    }
}

// acc[i] += this lane's share of row i's dot product over the pass loaded in p (a warp_sum
// completes it). SHARED_X: every row multiplies the same staged x, read once per chunk.
template <int BITS, int R, int U, bool SHARED_X>
__device__ __forceinline__ void use_pass(const RowRef (&rows)[R], int base, int lane, const Pass<R, U>& p,
                                         float (&acc)[R]) {
    float4 xv[8];
    float cs = 0.0f;
#pragma unroll
    for (int j = 0; j < U; ++j) {
        const int c = base + j * 32 + lane;
        if (SHARED_X) {
            if (c >= rows[0].chunks) continue;
            load_x<BITS>(rows[0], c, xv);
            if (BITS != 16) cs = rows[0].csum[c];
        }
#pragma unroll
        for (int i = 0; i < R; ++i) {
            if (rows[i].data == nullptr || c >= rows[i].chunks) continue;
            if (!SHARED_X) {
                load_x<BITS>(rows[i], c, xv);
                if (BITS != 16) cs = rows[i].csum[c];
            }
            acc[i] += chunk_dot<BITS>(p.u[i][j], xv, cs, p.scale[i][j], p.bias[i][j]);
        }
    }
}

// acc[i] += this lane's share of row i's dot product, for rows of BITS-bit weights with one group
// size, given the first pass already loaded in p (see load_pass). The x the rows refer to must be
// staged by now.
template <int BITS, int R, int U, bool SHARED_X>
__device__ __forceinline__ void dot_rows(const RowRef (&rows)[R], int max_chunks, int group, int lane, Pass<R, U>& p,
                                         float (&acc)[R]) {
    for (int base = 0;;) {
        use_pass<BITS, R, U, SHARED_X>(rows, base, lane, p, acc);
        base += 32 * U;
        if (base >= max_chunks) break;
        load_pass<BITS, R, U>(rows, base, group, lane, p);
    }
}

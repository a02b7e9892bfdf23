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
// Dequantisation without integer-to-float conversions: a 4-bit value q placed in the top
// mantissa bits of 1.0f gives f = 1 + q / 16 exactly, so sum(f * x) = csum + sum(q * x) / 16 and
// a chunk contributes scale * sum(q * x) + bias * csum = 16 * scale * F + (bias - 16 * scale) * csum.
// 8-bit values work the same way with 1 + q / 256.

// Floats of shared memory a staged input of `cols` values needs (x, then chunk sums), rounded
// to whole float4s.
__host__ __device__ __forceinline__ int staged_floats(int cols) { return cols + ((cols / 8 + 3) & ~3); }

// Writes x (times `inv` and `norm_scale` when non-null) in the staged layout for a weight of
// `bits` bits and `cols` inputs into `xs` (16-byte aligned). No barrier: see stage_chunk_sums.
__device__ __forceinline__ void stage_values(int bits, int cols, const float* x, const float* norm_scale, float inv,
                                             float* xs) {
    const int vpc = values_per_chunk(bits);
    const int chunks = cols / vpc;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = x[i] * inv;
        if (norm_scale != nullptr) v *= norm_scale[i];
        const int c = i / vpc, j = i % vpc;
        xs[((j >> 2) * chunks + c) * 4 + (j & 3)] = v;
    }
}

// The chunk sums after staged values (quantised weights only); call after a barrier that
// follows stage_values, and put a barrier before using them.
__device__ __forceinline__ void stage_chunk_sums(int bits, int cols, float* xs) {
    if (bits == 16) return;
    const int vpc = values_per_chunk(bits);
    const int chunks = cols / vpc;
    const float4* x4 = reinterpret_cast<const float4*>(xs);
    float* csum = xs + cols;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
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
    if (norm_scale != nullptr) {
        float ss = 0.0f;
        for (int i = threadIdx.x; i < cols; i += blockDim.x) ss += x[i] * x[i];
        ss = block_sum(ss, scratch);
        inv = rsqrtf(ss / cols + eps);
    }
    stage_values(bits, cols, x, norm_scale, inv, xs);
    __syncthreads();
    stage_chunk_sums(bits, cols, xs);
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

// 1 + q / 16 for the 4-bit value at nibble J of w.
template <int J>
__device__ __forceinline__ float nibble_f(uint32_t w) {
    const uint32_t m = J <= 4 ? (w << (19 - 4 * J)) : (w >> (4 * J - 19));
    return __uint_as_float(0x3F800000u | (m & 0x00780000u));
}

// 1 + q / 256 for the 8-bit value at byte J of w.
template <int J>
__device__ __forceinline__ float byte_f(uint32_t w) {
    const uint32_t m = J <= 1 ? (w << (15 - 8 * J)) : (w >> (8 * J - 15));
    return __uint_as_float(0x3F800000u | (m & 0x007F8000u));
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

// Chunk c of one row (its 16 bytes in u) dotted with the staged x.
template <int BITS>
__device__ __forceinline__ float chunk_dot(const RowRef& r, int c, uint4 u, float scale, float bias) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
    const int n = r.chunks;
    if (BITS == 16) {
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const float4 x = r.x[k * n + c];
            s += dot4(x, __uint_as_float(w[2 * k] << 16), __uint_as_float(w[2 * k] & 0xffff0000u),
                      __uint_as_float(w[2 * k + 1] << 16), __uint_as_float(w[2 * k + 1] & 0xffff0000u));
        }
        return s;
    } else if (BITS == 4) {
        float f = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            f += dot4(r.x[(2 * k) * n + c], nibble_f<0>(w[k]), nibble_f<1>(w[k]), nibble_f<2>(w[k]), nibble_f<3>(w[k]));
            f += dot4(r.x[(2 * k + 1) * n + c], nibble_f<4>(w[k]), nibble_f<5>(w[k]), nibble_f<6>(w[k]),
                      nibble_f<7>(w[k]));
        }
        const float s = scale * 16.0f;
        return s * f + (bias - s) * r.csum[c];
    } else {
        float f = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k)
            f += dot4(r.x[k * n + c], byte_f<0>(w[k]), byte_f<1>(w[k]), byte_f<2>(w[k]), byte_f<3>(w[k]));
        const float s = scale * 256.0f;
        return s * f + (bias - s) * r.csum[c];
    }
}

// acc[i] += this lane's share of row i's dot product over the pass loaded in p (a warp_sum
// completes it).
template <int BITS, int R, int U>
__device__ __forceinline__ void use_pass(const RowRef (&rows)[R], int base, int lane, const Pass<R, U>& p,
                                         float (&acc)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const int c = base + j * 32 + lane;
            if (rows[i].data != nullptr && c < rows[i].chunks)
                acc[i] += chunk_dot<BITS>(rows[i], c, p.u[i][j], p.scale[i][j], p.bias[i][j]);
        }
}

// acc[i] += this lane's share of row i's dot product, for rows of BITS-bit weights with one group
// size, given the first pass already loaded in p (see load_pass). The x the rows refer to must be
// staged by now.
template <int BITS, int R, int U>
__device__ __forceinline__ void dot_rows(const RowRef (&rows)[R], int max_chunks, int group, int lane, Pass<R, U>& p,
                                         float (&acc)[R]) {
    for (int base = 0;;) {
        use_pass<BITS, R, U>(rows, base, lane, p, acc);
        base += 32 * U;
        if (base >= max_chunks) break;
        load_pass<BITS, R, U>(rows, base, group, lane, p);
    }
}

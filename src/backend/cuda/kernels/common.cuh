// Shared definitions for lily's CUDA kernels: the weight descriptor every mat-vec kernel takes,
// bf16 conversion, and warp/block reductions. Prepended to every kernel source by the host.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
// NVRTC has no C library headers: the fixed-width types are spelled out.
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;

typedef __nv_bfloat16 bf16;

// Quantised weights' scales and biases: bf16, or fp16 when the host compiles the kernels with
// LILY_SCALES_F16 (a checkpoint whose scales are fp16 keeps them exact; see ScaleFormat).
#ifdef LILY_SCALES_F16
typedef __half scale_t;
__device__ __forceinline__ float scale_f32(scale_t v) { return __half2float(v); }
__device__ __forceinline__ float scale_bits_f32(unsigned short v) { return __half2float(__ushort_as_half(v)); }
__device__ __forceinline__ scale_t scale_zero() { return __float2half(0.0f); }
#else
typedef bf16 scale_t;
__device__ __forceinline__ float scale_f32(scale_t v) { return __bfloat162float(v); }
__device__ __forceinline__ float scale_bits_f32(unsigned short v) { return __uint_as_float(((unsigned int)v) << 16); }
__device__ __forceinline__ scale_t scale_zero() { return __float2bfloat16(0.0f); }
#endif

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// A weight matrix [rows, cols] on the device: dense bf16 (bits == 16) or MLX affine-quantised
// (bits 4 or 8: `data` holds uint32 words, 32/bits values each, first value in the low bits;
// one scale and bias (scale_t) per 2^group_shift consecutive inputs of a row; value = scale * q + bias).
struct Weight {
    const void* data;
    const scale_t* scales;
    const scale_t* biases;
    int rows;
    int cols;
    int bits;
    int group_shift;
};

// A batched decode step carries one token of each of several sequences, row b of its
// activations being sequence b's: `table[b]` is then the device address of sequence b's buffer
// (its position, cache or state). Without a table (null) a kernel serves one sequence and uses
// the buffer it was given, whose rows are consecutive tokens.
template <typename T>
__device__ __forceinline__ T* seq_buffer(T* own, const unsigned long long* table, int row) {
    return table != nullptr ? reinterpret_cast<T*>(table[row]) : own;
}

// The position of the token in row `row`: its sequence's position (batched), else position[0]
// plus the row (consecutive tokens of one sequence).
__device__ __forceinline__ int row_position(const int* position, const unsigned long long* position_of, int row) {
    return position_of != nullptr ? *reinterpret_cast<const int*>(position_of[row]) : position[0] + row;
}

__device__ __forceinline__ float bf16_to_f32(uint16_t v) {
    return __uint_as_float(((uint32_t)v) << 16);
}

// Element (row, col) of w as f32 (dequantised): for the few kernels that read single values
// (the embedding lookup, the router's fold at load time), not the mat-vec paths.
__device__ __forceinline__ float weight_value(const Weight& w, size_t row, int col) {
    if (w.bits == 16) return bf16_to_f32(static_cast<const uint16_t*>(w.data)[row * w.cols + col]);
    const int per_word = 32 / w.bits;
    const uint32_t word = static_cast<const uint32_t*>(w.data)[(row * w.cols + col) / per_word];
    const uint32_t q = (word >> (w.bits * (col % per_word))) & ((1u << w.bits) - 1u);
    const size_t g = row * (w.cols >> w.group_shift) + (col >> w.group_shift);
    return scale_f32(w.scales[g]) * (float)q + scale_f32(w.biases[g]);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block; every thread gets the result. `scratch` holds at least 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(t);
}

// Maximum over the block; every thread gets the result. `scratch` holds at least 32 floats.
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_max(lane < warps ? scratch[lane] : -INFINITY);
}

#ifdef LILY_TRACE_BUF
// Block timelines for `lily bench --trace` (compiled in only then): every traced block appends
// (grid id, SM << 32 | block, start, end of its wait, exit) in %globaltimer nanoseconds to the
// buffer at LILY_TRACE_BUF (word 0: records written, records from word 8, at most LILY_TRACE_CAP;
// the layout timing.rs decodes).
__shared__ unsigned long long trace_stamps[2];
__shared__ unsigned int trace_exited;
__shared__ unsigned long long trace_slot;
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
struct BlockTrace {
    // The record's slot is taken at the start, so that the exit stamp is followed by stores only.
    __device__ BlockTrace() {
        if (threadIdx.x + threadIdx.y + threadIdx.z == 0) {
            trace_stamps[0] = global_ns();
            trace_stamps[1] = 0;
            trace_exited = 0;
            trace_slot = atomicAdd(reinterpret_cast<unsigned long long*>(LILY_TRACE_BUF), 1ull);
        }
        __syncthreads();
    }
    __device__ ~BlockTrace() {
        if (atomicAdd(&trace_exited, 1u) != blockDim.x * blockDim.y * blockDim.z - 1) return;
        const unsigned long long end = global_ns();
        unsigned long long* buf = reinterpret_cast<unsigned long long*>(LILY_TRACE_BUF);
        const unsigned long long i = trace_slot;
        if (i >= LILY_TRACE_CAP) return;
        unsigned long long grid;
        unsigned sm;
        asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid));
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        unsigned long long* r = buf + 8 + i * 5;
        r[0] = grid;
        r[1] = ((unsigned long long)sm << 32) | block;
        r[2] = trace_stamps[0];
        r[3] = trace_stamps[1];
        r[4] = end;
    }
};
#define TRACE_BLOCK() BlockTrace block_trace
#else
#define TRACE_BLOCK()
#endif

// Programmatic dependent launch (sm_90): the host launches every decode kernel so that it may
// start while the previous kernel finishes. A kernel calls wait_for_previous_kernel() before it
// reads anything the previous launch wrote and before it writes anything; after the wait it lets
// the next kernel start. So when a kernel starts, the launch before the previous one has
// finished and its writes are visible: before its wait a kernel may read its weights and
// whatever was written two or more launches back (decode reads residual rows, cached keys and
// values, the MoE's input that way), provided some block of the previous kernel waits (the next
// launch starts once every block has waited or exited, so a kernel whose blocks all exited
// without waiting would let it start early, as let_next_kernel_start below does on purpose).
// Both are no-ops for an ordinary launch.
__device__ __forceinline__ void wait_for_previous_kernel() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
#ifdef LILY_TRACE_BUF
    if (threadIdx.x + threadIdx.y + threadIdx.z == 0 && trace_stamps[1] == 0) trace_stamps[1] = global_ns();
#endif
    asm volatile("griddepcontrol.launch_dependents;" :::);
}

// Lets the next kernel start now, before this one waits: only for a kernel whose successor reads
// before its own wait nothing the previous kernel writes (its successor may then run beside the
// previous kernel), so that the successor's blocks become resident, and request what they can,
// as the previous kernel's blocks leave rather than once it has finished.
__device__ __forceinline__ void let_next_kernel_start() { asm volatile("griddepcontrol.launch_dependents;" :::); }

// With the approximate reciprocal (2 ulp): an IEEE division is a dozen instructions, and these sit
// on the decode kernels' short critical paths. A denominator overflowing to infinity gives 0.
__device__ __forceinline__ float silu(float x) { return __fdividef(x, 1.0f + __expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : __logf(1.0f + __expf(x)); }

// v / d and v % d for v >= 0, d > 0: by a shift and a mask where d is a power of two (every
// shape of the real models), else by the division (~20 dependent instructions, which the
// kernels' short critical paths feel).
__device__ __forceinline__ int div_fast(int v, int d) { return (d & (d - 1)) == 0 ? v >> (__ffs(d) - 1) : v / d; }
__device__ __forceinline__ int mod_fast(int v, int d) { return (d & (d - 1)) == 0 ? v & (d - 1) : v % d; }

// Values held by one 16-byte load of a row.
__device__ __forceinline__ int values_per_chunk(int bits) { return 128 / bits; }

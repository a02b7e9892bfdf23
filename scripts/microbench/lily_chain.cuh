// What the microbenchmarks that run lily's own kernels share (not part of lily): lily's kernel
// sources, the bulk-copy and mbarrier instructions, a block's slice of rows dotted from shared
// memory with lily's integer dot, and a chain of random 4-bit products with its input and output
// buffers.
#pragma once
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

// lily's kernels, as NVRTC sees them (its prelude spells out uint64_t differently from glibc).
#define uint64_t lily_uint64_t
#include "../../src/backend/cuda/kernels/common.cuh"
#include "../../src/backend/cuda/kernels/rowdot.cuh"
#include "../../src/backend/cuda/kernels/matvec.cu"
#undef uint64_t

#include "chain_host.h"

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_to_shared(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done)
        asm volatile(
            "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
}
__device__ __forceinline__ float lds_scale(uint32_t address) {
    unsigned short v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(address));
    return scale_bits_f32(v);
}

// The first row of resident block b of `blocks` (rows dealt as evenly as they divide).
__host__ __device__ inline int resident_rows(int rows, int blocks, int b) { return (int)((long long)rows * b / blocks); }

// This lane's chunks c = lane + 32 j of x staged by lily's stage(), held in registers for every
// row a warp dots.
template <int CPL>
struct HeldX {
    uint4 q[CPL][4];
    float2 stats[CPL];
};

template <int CPL>
__device__ __forceinline__ void hold_x(const float* xs, int cols, HeldX<CPL>& x) {
    const int lane = threadIdx.x & 31;
    const StagedX sx = staged_x<4>(xs, cols);
#pragma unroll
    for (int j = 0; j < CPL; ++j) {
        const int c = lane + 32 * j;
        load_x<4>(sx, c, x.q[j]);
        x.stats[j] = lds64(sx.csum + 8u * c);
    }
}

// y[r] = inv * (row r of the slice . x) for the slice's nrows 4-bit rows of `cols` values in
// shared memory (rows at ws, their bf16 scales at ss and biases at bs), two rows a warp at a
// time, warps `warp` of `warps`.
template <int CPL>
__device__ void dot_resident_rows(int cols, int nrows, uint32_t ws, uint32_t ss, uint32_t bs, const HeldX<CPL>& x,
                                  float inv, float* y, int warp, int warps) {
    const int lane = threadIdx.x & 31, row_bytes = cols / 2, groups = cols / 64;
    for (int r = warp; r < nrows; r += 2 * warps) {
        const int rr[2] = {r, r + warps};
        float acc[2] = {0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            if (rr[i] >= nrows) continue;
#pragma unroll
            for (int j = 0; j < CPL; ++j) {
                const int c = lane + 32 * j;
                const uint4 u = lds128(ws + rr[i] * row_bytes + c * 16);
                const uint32_t g = (rr[i] * groups + (c >> 1)) * 2;
                const float s = lds_scale(ss + g), b = lds_scale(bs + g);
                int q = word_dot4(u.x, x.q[j][0], 0);
                q = word_dot4(u.y, x.q[j][1], q);
                q = word_dot4(u.z, x.q[j][2], q);
                q = word_dot4(u.w, x.q[j][3], q);
                acc[i] = fmaf(s * x.stats[j].x, static_cast<float>(q), acc[i]);
                acc[i] = fmaf(b, x.stats[j].y, acc[i]);
            }
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const float v = warp_sum(acc[i]) * inv;
            if (lane == 0 && rr[i] < nrows) y[rr[i]] = v;
        }
    }
}

__device__ __forceinline__ uint32_t mix(uint32_t v) {
    v ^= v >> 16;
    v *= 0x7feb352du;
    v ^= v >> 15;
    v *= 0x846ca68bu;
    v ^= v >> 16;
    return v;
}

__global__ void fill_weights(uint32_t* data, scale_t* scales, scale_t* biases, size_t words, size_t groups, int cols,
                             uint32_t seed) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += stride) data[i] = mix((uint32_t)i * 2654435761u ^ seed);
    const float s0 = 1.0f / (4.0f * sqrtf((float)cols));
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < groups; i += stride) {
        const float s = s0 * (0.5f + (mix((uint32_t)i ^ seed ^ 0x5bd1e995u) & 1023) / 1024.0f);
        scales[i] = __float2bfloat16(s);
        biases[i] = __float2bfloat16(-7.5f * s);
    }
}

// A chain of `products` dependent 4-bit products (group 64) with random weights, shapes repeated
// from the list (COLS 2048 or 4096, each reading the first COLS outputs of the one before): the
// weights, their bytes, the chain's input x0 (a sine), a norm of ones and one output buffer per
// product (x_len floats each, zeroed).
struct Chain {
    std::vector<Weight> layers;
    size_t total_bytes = 0;
    int x_len = 0;
    float *x0 = nullptr, *norm = nullptr;
    std::vector<float*> ys;
};

// False, with a message, where the shapes do not chain.
inline bool make_chain(const std::vector<std::pair<int, int>>& shapes, int products, Chain& c) {
    c.layers.resize(products);
    int max_rows = 0;
    for (int i = 0; i < products; ++i) {
        Weight& l = c.layers[i];
        l.rows = shapes[i % shapes.size()].first;
        l.cols = shapes[i % shapes.size()].second;
        l.bits = 4;
        l.group_shift = 6;
        if ((l.cols != 2048 && l.cols != 4096) || (i > 0 && l.cols > std::max(c.layers[i - 1].rows, 4096))) {
            printf("product %d: %dx%d does not chain\n", i, l.rows, l.cols);
            return false;
        }
        max_rows = std::max(max_rows, l.rows);
        const size_t words = (size_t)l.rows * l.cols / 8, groups = (size_t)l.rows * l.cols / 64;
        uint32_t* d;
        scale_t *s, *b;
        CHECK(cudaMalloc(&d, words * 4));
        CHECK(cudaMalloc(&s, groups * 2));
        CHECK(cudaMalloc(&b, groups * 2));
        fill_weights<<<1024, 256>>>(d, s, b, words, groups, l.cols, 0x9E3779B9u * (i + 1));
        l.data = d;
        l.scales = s;
        l.biases = b;
        c.total_bytes += words * 4 + groups * 4;
    }
    c.x_len = std::max(max_rows, 8192);
    std::vector<float> hx(c.x_len), ones(c.x_len, 1.0f);
    for (int i = 0; i < c.x_len; ++i) hx[i] = std::sin(0.37f * i);
    CHECK(cudaMalloc(&c.x0, c.x_len * 4));
    CHECK(cudaMalloc(&c.norm, c.x_len * 4));
    CHECK(cudaMemcpy(c.x0, hx.data(), c.x_len * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(c.norm, ones.data(), c.x_len * 4, cudaMemcpyHostToDevice));
    c.ys.resize(products);
    for (int i = 0; i < products; ++i) {
        CHECK(cudaMalloc(&c.ys[i], c.x_len * 4));
        CHECK(cudaMemset(c.ys[i], 0, c.x_len * 4));
    }
    return true;
}

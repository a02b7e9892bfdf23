// What the chain microbenchmarks share on the device (not part of lily): 4-bit weights in
// 16-byte chunks of 32 nibbles with a half2 (scale, bias) per 64 values, x staged as half2, one
// chunk's dot, the row requests and the random weights.
#pragma once
#include <cuda_fp16.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <cmath>

#include "chain_host.h"

struct Layer {
    const uint4* w;      // [rows][cols / 32] chunks
    const __half2* sb;   // [rows][cols / 64] (scale, bias)
    int rows, cols;
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// x staged as half2 pairs in the order the nibble extraction yields them: for chunk c, word k,
// i < 4: (x[32c + 8k + i], x[32c + 8k + i + 4]), the four pairs of (c, k) as one 16-byte entry at
// k * chunks + c (lanes reading consecutive chunks hit distinct banks); plus each chunk's sum of x
// (for the bias). stage_chunk stages chunk c from its 32 values.
__device__ __forceinline__ void stage_chunk(const float (&v)[32], int chunks, int c, uint4* xs, float* xsum) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float* e = v + 8 * k;
        const __half2 p0 = __floats2half2_rn(e[0], e[4]), p1 = __floats2half2_rn(e[1], e[5]);
        const __half2 p2 = __floats2half2_rn(e[2], e[6]), p3 = __floats2half2_rn(e[3], e[7]);
        uint4 q;
        q.x = *reinterpret_cast<const uint32_t*>(&p0);
        q.y = *reinterpret_cast<const uint32_t*>(&p1);
        q.z = *reinterpret_cast<const uint32_t*>(&p2);
        q.w = *reinterpret_cast<const uint32_t*>(&p3);
        xs[k * chunks + c] = q;
        s += (e[0] + e[1]) + (e[2] + e[3]) + (e[4] + e[5]) + (e[6] + e[7]);
    }
    xsum[c] = s;
}

__device__ void stage_x(const float* x, int cols, uint4* xs, float* xsum) {
    const int chunks = cols / 32;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        const float4* x4 = reinterpret_cast<const float4*>(x + 32 * c);
        float v[32];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float4 f = __ldcg(x4 + j);
            v[4 * j] = f.x;
            v[4 * j + 1] = f.y;
            v[4 * j + 2] = f.z;
            v[4 * j + 3] = f.w;
        }
        stage_chunk(v, chunks, c, xs, xsum);
    }
}

// One chunk's 32 products: scale * sum(q x) + bias * sum(x).
__device__ __forceinline__ float chunk_dot(uint4 u, const uint4* xs, int chunks, int c, float xsum, __half2 sb) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
    __half2 acc = __float2half2_rn(0.0f);
    const __half2 magic = __float2half2_rn(1024.0f);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const uint4 xv = xs[k * chunks + c];
        const uint32_t xw[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t t = ((w[k] >> (4 * i)) & 0x000F000Fu) | 0x64006400u;
            const __half2 q = __hsub2(*reinterpret_cast<const __half2*>(&t), magic);
            acc = __hfma2(q, *reinterpret_cast<const __half2*>(&xw[i]), acc);
        }
    }
    const float2 a = __half22float2(acc);
    const float2 s = __half22float2(sb);
    return s.x * (a.x + a.y) + s.y * xsum;
}

// Requests this lane's chunks of `row` and their scale/bias pairs (at most MAX_U per lane).
template <int MAX_U>
__device__ __forceinline__ void load_row(const Layer& l, int row, int lane, uint4 (&u)[MAX_U], __half2 (&sb)[MAX_U]) {
    const int chunks = l.cols / 32, per_lane = chunks / 32;
#pragma unroll
    for (int j = 0; j < MAX_U; ++j)
        if (j < per_lane) {
            const int c = j * 32 + lane;
            u[j] = l.w[(size_t)row * chunks + c];
            sb[j] = l.sb[(size_t)row * (chunks / 2) + c / 2];
        }
}

__global__ void fill_weights(uint4* w, __half2* sb, size_t chunks, size_t groups, int cols, uint32_t seed) {
    const float scale = 2.0f / (15.0f * sqrtf((float)cols));
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < chunks; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        uint32_t v[4];
        for (int k = 0; k < 4; ++k) {
            h ^= h << 13; h ^= h >> 17; h ^= h << 5;
            v[k] = h;
        }
        w[i] = make_uint4(v[0], v[1], v[2], v[3]);
        if (i < groups) sb[i] = __floats2half2_rn(scale, -7.5f * scale);
    }
}


// Microbenchmark (not part of lily): what a dependency inside a thread-block cluster costs, next
// to grid_sync.cu's grid-wide ones. A persistent kernel of 128 blocks (clusters of C = 4, 8 or 16
// blocks, 256 threads each) runs HOPS steps; in each, every block sums the 2,048-float vector in
// its own shared memory (a block reduction), computes its 2048 / C values of the next vector
// from it and stores them into every block of its cluster (distributed shared memory), then the
// cluster synchronises (barrier.cluster arrive.release / wait.acquire). As a per-head fused
// DeltaNet layer would exchange its input-projection rows, norm partials and outputs.
// Also: the barrier alone (no exchange).
//   nvcc -O3 -arch=sm_90a -std=c++17 -o cluster_sync scripts/microbench/cluster_sync.cu && ./cluster_sync
#include <cooperative_groups.h>
#include <algorithm>

#include "chain_common.cuh"

namespace cg = cooperative_groups;

constexpr int N = 2048, THREADS = 256, BLOCKS = 128;

// exchange 0: the barrier alone.
__global__ void __launch_bounds__(THREADS) cluster_chain(int hops, int exchange, float* out) {
    __shared__ float buf[2][N];
    __shared__ float red[THREADS / 32];
    cg::cluster_group cluster = cg::this_cluster();
    const unsigned size = cluster.num_blocks(), rank = cluster.block_rank();
    for (int i = threadIdx.x; i < N; i += THREADS) buf[0][i] = 1.0f + (i % 7) * 0.125f;
    cluster.sync();
    const int per = N / size;
    for (int h = 0; h < hops; ++h) {
        const float* cur = buf[h & 1];
        float s = 0.0f;
        for (int i = threadIdx.x; i < N; i += THREADS) s += cur[i];
        s = warp_sum(s);
        if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
        __syncthreads();
        float total = 0.0f;
        for (int w = 0; w < THREADS / 32; ++w) total += red[w];
        if (exchange) {
            for (int i = threadIdx.x; i < per; i += THREADS) {
                const int j = rank * per + i;
                const float v = 0.5f * cur[j] + 1e-3f * total / N;
                for (unsigned r = 0; r < size; ++r) cluster.map_shared_rank(&buf[(h + 1) & 1][0], r)[j] = v;
            }
        }
        cluster.sync();
    }
    if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = buf[hops & 1][0];
}

int main() {
    float* out;
    CHECK(cudaMalloc(&out, 4));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    CHECK(cudaFuncSetAttribute(cluster_chain, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    for (int size : {4, 8, 16}) {
        for (int exchange = 0; exchange < 2; ++exchange) {
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(BLOCKS);
            cfg.blockDim = dim3(THREADS);
            cudaLaunchAttribute attr;
            attr.id = cudaLaunchAttributeClusterDimension;
            attr.val.clusterDim.x = size;
            attr.val.clusterDim.y = 1;
            attr.val.clusterDim.z = 1;
            cfg.attrs = &attr;
            cfg.numAttrs = 1;
            auto time = [&](int hops) {
                return median_us(30, 0, e0, e1, [] {},
                                 [&] { CHECK(cudaLaunchKernelEx(&cfg, cluster_chain, hops, exchange, out)); });
            };
            const int hops = 256;
            const float one = time(1), all = time(hops);
            printf("cluster %2d, %-22s %6.3f us per step\n", size, exchange ? "exchange + barrier" : "barrier alone",
                   (all - one) / (hops - 1));
        }
    }
    return 0;
}

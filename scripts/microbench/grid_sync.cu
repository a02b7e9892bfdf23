// Microbenchmark (not part of lily): what one grid-wide dependency costs, without weights. A
// chain of HOPS steps, each one block per SM: every block reads the whole 2,048-float vector the
// previous step wrote (from L2, 8 KB), sums it, and writes its slice of the next vector (every
// output depends on every input, as in a mat-vec). How a step learns that its input is complete:
//   pdl         a kernel per step, programmatic dependent launch, griddepcontrol.wait (lily);
//   flag        one persistent kernel; after its stores a block's thread 0 publishes them with
//               red.release.gpu (a per-step counter), the next step's thread 0 polls the counter
//               with ld.acquire.gpu, then a block barrier;
//   flag-fence  the same with __threadfence() + atomicAdd (as persistent_chain.cu);
//   flag-all    the same as flag, every warp's lane 0 polls (no block barrier after the poll);
//   grid.sync   one persistent cooperative kernel, cooperative_groups::this_grid().sync().
// Reported per step; the pdl chain is replayed as a CUDA graph, the persistent ones launched
// alone (their launch, ~5 us, is subtracted by timing a one-step launch).
//   nvcc -O3 -arch=sm_90a -std=c++17 -o grid_sync scripts/microbench/grid_sync.cu && ./grid_sync
#include <cooperative_groups.h>
#include <algorithm>

#include "chain_common.cuh"

constexpr int N = 2048, THREADS = 256, HOPS = 64;

// One step's work for this block: the sum of x (a block reduction), then the block's slice of
// y[j] = 0.5 x[j] + 1e-3 * sum / N.
__device__ __forceinline__ void step(const float* x, float* y, float* red) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float s = 0.0f;
    for (int i = threadIdx.x; i < N / 4; i += blockDim.x) {
        const float4 v = x4[i];
        s += (v.x + v.y) + (v.z + v.w);
    }
    s = warp_sum(s);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < THREADS / 32; ++w) total += red[w];
    const int per = (N + gridDim.x - 1) / gridDim.x, j0 = blockIdx.x * per;
    for (int j = j0 + threadIdx.x; j < min(N, j0 + per); j += blockDim.x) y[j] = 0.5f * x[j] + 1e-3f * total / N;
    __syncthreads();
}

__global__ void __launch_bounds__(THREADS) pdl_step(const float* x, float* y) {
    __shared__ float red[THREADS / 32];
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
    step(x, y, red);
}

// mode 0 flag, 1 flag-fence, 2 flag-all. counters[h]: blocks done with step h, counted from
// `base` (this launch's first value).
__global__ void __launch_bounds__(THREADS) flag_chain(float* const* bufs, int hops, unsigned* counters, unsigned base,
                                                     int mode) {
    __shared__ float red[THREADS / 32];
    const unsigned target = base + gridDim.x;
    for (int h = 0; h < hops; ++h) {
        if (h > 0) {
            const bool poller = mode == 2 ? (threadIdx.x & 31) == 0 : threadIdx.x == 0;
            if (poller) {
                unsigned seen;
                do {
                    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counters + h - 1) : "memory");
                } while (seen < target);
            }
            if (mode == 2) __syncwarp();
            else __syncthreads();
        }
        step(bufs[h], bufs[h + 1], red);
        if (threadIdx.x == 0) {
            if (mode == 1) {
                __threadfence();
                atomicAdd(counters + h, 1u);
            } else {
                asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counters + h) : "memory");
            }
        }
    }
}

__global__ void __launch_bounds__(THREADS) coop_chain(float* const* bufs, int hops) {
    __shared__ float red[THREADS / 32];
    cooperative_groups::grid_group g = cooperative_groups::this_grid();
    for (int h = 0; h < hops; ++h) {
        if (h > 0) g.sync();
        step(bufs[h], bufs[h + 1], red);
    }
}

int main() {
    int sms;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    std::vector<float*> hb(HOPS + 1);
    std::vector<float> ones(N);
    for (int i = 0; i < N; ++i) ones[i] = 1.0f + (i % 7) * 0.125f;
    for (auto& b : hb) CHECK(cudaMalloc(&b, N * 4));
    CHECK(cudaMemcpy(hb[0], ones.data(), N * 4, cudaMemcpyHostToDevice));
    float** bufs;
    CHECK(cudaMalloc(&bufs, (HOPS + 1) * sizeof(float*)));
    CHECK(cudaMemcpy(bufs, hb.data(), (HOPS + 1) * sizeof(float*), cudaMemcpyHostToDevice));
    unsigned* counters;
    CHECK(cudaMalloc(&counters, HOPS * 4));
    CHECK(cudaMemset(counters, 0, HOPS * 4));
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    const int reps = 200;
    std::vector<float> ref(N), out(N);

    // pdl: a graph of HOPS kernels.
    {
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        for (int h = 0; h < HOPS; ++h) {
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(sms);
            cfg.blockDim = dim3(THREADS);
            cfg.stream = s;
            cfg.attrs = &attr;
            cfg.numAttrs = 1;
            CHECK(cudaLaunchKernelEx(&cfg, pdl_step, (const float*)hb[h], hb[h + 1]));
        }
        CHECK(cudaStreamEndCapture(s, &graph));
        CHECK(cudaGraphInstantiate(&exec, graph, 0));
        for (int r = 0; r < 10; ++r) CHECK(cudaGraphLaunch(exec, s));
        printf("%-12s %6.3f us per step\n", "pdl", replay_us(exec, s, reps, e0, e1) / HOPS);
        CHECK(cudaMemcpy(ref.data(), hb[HOPS], N * 4, cudaMemcpyDeviceToHost));
    }
    // Persistent: each launch timed alone; a one-step launch of the same kernel is subtracted.
    unsigned base = 0;
    const char* names[] = {"flag", "flag-fence", "flag-all", "grid.sync"};
    for (int mode = 0; mode < 4; ++mode) {
        auto launch = [&](int hops) {
            if (mode < 3) {
                flag_chain<<<sms, THREADS, 0, s>>>(bufs, hops, counters, base, mode);
                base += sms;
            } else {
                int h = hops;
                void* args[] = {&bufs, &h};
                CHECK(cudaLaunchCooperativeKernel((void*)coop_chain, dim3(sms), dim3(THREADS), args, 0, s));
            }
        };
        auto time = [&](int hops) {
            // Counters run on from one launch to the next: each launch waits for base + sms.
            auto reset = [&] {
                CHECK(cudaMemsetAsync(counters, 0, HOPS * 4, s));
                base = 0;
            };
            return median_us(50, s, e0, e1, reset, [&] { launch(hops); });
        };
        const float one = time(1), all = time(HOPS);
        printf("%-12s %6.3f us per step (launch of %d steps %.1f us, of one %.1f us)\n", names[mode],
               (all - one) / (HOPS - 1), HOPS, all, one);
        CHECK(cudaMemcpy(out.data(), hb[HOPS], N * 4, cudaMemcpyDeviceToHost));
        double d = 0;
        for (int i = 0; i < N; ++i) d = std::max(d, (double)std::abs(out[i] - ref[i]));
        printf("             max |difference from pdl| %.3e\n", d);
    }
    return 0;
}

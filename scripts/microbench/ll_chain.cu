// Microbenchmark (not part of lily): what a kernel boundary costs in a chain of dependent 4-bit
// mat-vecs launched with programmatic dependent launch and replayed as a CUDA graph, by how a
// kernel learns that its input is ready:
//   wait       lily's structure: rows requested, griddepcontrol.wait, launch_dependents, x read
//              from global memory and staged, dot, plain float stores;
//   wait-early the same with launch_dependents at the kernel's start;
//   flagged    no griddepcontrol.wait at all: launch_dependents at the start, outputs stored as
//              8-byte (value, epoch) pairs (NCCL's "LL" layout), and a consumer stages x by polling
//              the pairs until every epoch is the one it expects; the epoch is a per-replay
//              counter bumped by a last kernel, times 64, plus the product's index.
// Products given as ROWSxCOLS,... (repeated to 40; each product reads the first COLS outputs of
// the one before), weights in 16-byte chunks of 32 nibbles, a half2 scale/bias per 64 values.
//   nvcc -O3 -arch=sm_90a -std=c++17 -o ll_chain ll_chain.cu && ./ll_chain 4096x2048,2048x4096
#include "chain_common.cuh"

// How the pairs are stored and polled: `volatile` (relaxed, system scope, as NCCL's LL) or, with
// -DPAIR_SCOPE='"relaxed.gpu"', relaxed at GPU scope.
#ifndef PAIR_SCOPE
#define PAIR_SCOPE "volatile"
#endif

constexpr int PRODUCTS = 40, THREADS = 256, MAX_U = 8, MAX_COLS = 8192;

// x staged from (value, epoch) pairs: polls each 32-value chunk until all its epochs are `epoch`.
__device__ void stage_x_flagged(const uint2* x, int cols, uint32_t epoch, bool backoff, uint4* xs, float* xsum) {
    const int chunks = cols / 32;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        const uint4* src = reinterpret_cast<const uint4*>(x + 32 * c);
        float v[32];
        for (;;) {
            bool ok = true;
#pragma unroll
            for (int k = 0; k < 16; ++k) {
                uint4 u;
                asm volatile("ld." PAIR_SCOPE ".global.v4.u32 {%0,%1,%2,%3}, [%4];"
                             : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
                             : "l"(src + k));
                v[2 * k] = __uint_as_float(u.x);
                v[2 * k + 1] = __uint_as_float(u.z);
                ok &= (u.y == epoch) & (u.w == epoch);
            }
            if (ok) break;
            if (backoff) __nanosleep(200);
        }
        stage_chunk(v, chunks, c, xs, xsum);
    }
}

// mode 0: wait; 1: wait-early; 2: flagged; 3: flagged, dependents launched once x is staged (so
// at most the next kernel's blocks poll); 4: flagged with a backoff between polls; 5: both.
// index: the product's place in the chain.
__global__ void __launch_bounds__(THREADS) chain_matvec(Layer l, const float* x, float* y, const uint2* xf, uint2* yf,
                                                      const unsigned* step, int index, int mode) {
    extern __shared__ __align__(16) unsigned char smem[];
    uint4* xs = reinterpret_cast<uint4*>(smem);
    float* xsum = reinterpret_cast<float*>(smem + (size_t)l.cols / 32 * 64);
    const int lane = threadIdx.x & 31, warps = blockDim.x / 32;
    const int chunks = l.cols / 32, per_lane = chunks / 32;
    int row = blockIdx.x * warps + threadIdx.x / 32;
    const int stride = gridDim.x * warps;
    uint32_t epoch = 0;
    const bool flagged = mode >= 2, late = mode == 3 || mode == 5, backoff = mode >= 4;
    if (flagged) {
        epoch = *(volatile const unsigned*)step * 64u + (uint32_t)index;
        // The epoch is formed before dependents may start (the last kernel bumps the step).
        asm volatile("" ::"r"(epoch));
    }
    if (mode == 1 || (flagged && !late)) asm volatile("griddepcontrol.launch_dependents;");
    uint4 u[MAX_U];
    __half2 sb[MAX_U];
    if (row < l.rows) load_row(l, row, lane, u, sb);
    if (flagged) {
        if (index == 0) stage_x(x, l.cols, xs, xsum);
        else stage_x_flagged(xf, l.cols, epoch, backoff, xs, xsum);
        if (late) asm volatile("griddepcontrol.launch_dependents;");
    } else {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        if (mode == 0) asm volatile("griddepcontrol.launch_dependents;");
        stage_x(index == 0 ? x : x, l.cols, xs, xsum);
    }
    __syncthreads();
    for (; row < l.rows; row += stride) {
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < MAX_U; ++j)
            if (j < per_lane) {
                const int c = j * 32 + lane;
                acc += chunk_dot(u[j], xs, chunks, c, xsum[c], sb[j]);
            }
        acc = warp_sum(acc);
        if (lane == 0) {
            if (flagged) {
                const unsigned long long p =
                    (unsigned long long)__float_as_uint(acc) | ((unsigned long long)(epoch + 1) << 32);
                asm volatile("st." PAIR_SCOPE ".global.u64 [%0], %1;" ::"l"(yf + row), "l"(p) : "memory");
            } else {
                y[row] = acc;
            }
        }
        const int next = row + stride;
        if (next < l.rows) load_row(l, next, lane, u, sb);
    }
}

// The chain's last launch: waits for the last product, then bumps the replay counter.
__global__ void bump_step(unsigned* step) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    *step += 1;
}

// Copies the last flagged product's values out (for the comparison).
__global__ void unpack(const uint2* yf, float* y, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = __uint_as_float(yf[i].x);
}

int main(int argc, char** argv) {
    const char* spec = argc > 1 ? argv[1] : "4096x2048,2048x4096";
    std::vector<std::pair<int, int>> shapes;
    if (!parse_shapes(spec, shapes)) return 1;
    int sms;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    std::vector<Layer> layers(PRODUCTS);
    size_t total_bytes = 0;
    int max_rows = 0;
    for (int i = 0; i < PRODUCTS; ++i) {
        Layer& l = layers[i];
        l.rows = shapes[i % shapes.size()].first;
        l.cols = shapes[i % shapes.size()].second;
        if (l.cols % 1024 != 0 || l.cols > MAX_COLS || (i > 0 && l.cols > layers[i - 1].rows)) {
            printf("product %d: %dx%d does not chain\n", i, l.rows, l.cols);
            return 1;
        }
        max_rows = std::max(max_rows, l.rows);
        const size_t chunks = (size_t)l.rows * l.cols / 32, groups = (size_t)l.rows * l.cols / 64;
        uint4* w;
        __half2* sb;
        CHECK(cudaMalloc(&w, chunks * 16));
        CHECK(cudaMalloc(&sb, groups * 4));
        fill_weights<<<1024, 256>>>(w, sb, chunks, groups, l.cols, 0x9E3779B9u * (i + 1));
        l.w = w;
        l.sb = sb;
        total_bytes += chunks * 16 + groups * 4;
    }
    const int x_len = std::max(max_rows, MAX_COLS);
    float* x0;
    CHECK(cudaMalloc(&x0, x_len * 4));
    std::vector<float> hx(x_len);
    for (int i = 0; i < x_len; ++i) hx[i] = std::sin(0.37f * i);
    CHECK(cudaMemcpy(x0, hx.data(), x_len * 4, cudaMemcpyHostToDevice));
    std::vector<float*> ys(PRODUCTS);
    std::vector<uint2*> yfs(PRODUCTS);
    for (int i = 0; i < PRODUCTS; ++i) {
        CHECK(cudaMalloc(&ys[i], x_len * 4));
        CHECK(cudaMalloc(&yfs[i], x_len * 8));
        CHECK(cudaMemset(yfs[i], 0, x_len * 8));
    }
    unsigned* step;
    CHECK(cudaMalloc(&step, 4));
    CHECK(cudaMemset(step, 0, 4));
    float* last;
    CHECK(cudaMalloc(&last, x_len * 4));
    cudaStream_t stream;
    CHECK(cudaStreamCreate(&stream));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    CHECK(cudaFuncSetAttribute(chain_matvec, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024));
    const int reps = 200;
    const char* names[] = {"wait (lily)", "wait, dependents early", "flagged (LL pairs)", "flagged, dependents late",
                           "flagged, backoff", "flagged, late, backoff"};
    const int modes = 6;
    std::vector<std::vector<float>> outs;
    for (int mode = 0; mode < modes; ++mode) {
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        for (int i = 0; i < PRODUCTS; ++i) {
            const Layer& l = layers[i];
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(std::min(l.rows / (THREADS / 32), 3 * sms));
            cfg.blockDim = dim3(THREADS);
            cfg.dynamicSmemBytes = l.cols / 32 * 64 + l.cols / 32 * 4;
            cfg.stream = stream;
            cfg.attrs = &attr;
            cfg.numAttrs = 1;
            const float* x = i == 0 ? x0 : ys[i - 1];
            const uint2* xf = i == 0 ? nullptr : yfs[i - 1];
            CHECK(cudaLaunchKernelEx(&cfg, chain_matvec, l, x, ys[i], xf, yfs[i], (const unsigned*)step, i, mode));
        }
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(1);
        cfg.blockDim = dim3(1);
        cfg.stream = stream;
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        CHECK(cudaLaunchKernelEx(&cfg, bump_step, step));
        CHECK(cudaStreamEndCapture(stream, &graph));
        CHECK(cudaGraphInstantiate(&exec, graph, 0));
        for (int r = 0; r < 10; ++r) CHECK(cudaGraphLaunch(exec, stream));
        CHECK(cudaStreamSynchronize(stream));
        const double us = replay_us(exec, stream, reps, e0, e1);
        printf("%-26s %8.1f us per chain, %6.2f us per product, %6.0f GB/s\n", names[mode], us, us / PRODUCTS,
               total_bytes / (us * 1e3));
        // The second product's outputs (the first read from flagged pairs; later ones fall below
        // what the half-precision staging resolves).
        const int n = layers[1].rows;
        if (mode >= 2) unpack<<<64, 256, 0, stream>>>(yfs[1], last, n);
        else CHECK(cudaMemcpyAsync(last, ys[1], n * 4, cudaMemcpyDeviceToDevice, stream));
        std::vector<float> h(n);
        CHECK(cudaMemcpy(h.data(), last, n * 4, cudaMemcpyDeviceToHost));
        outs.push_back(h);
        CHECK(cudaGraphExecDestroy(exec));
        CHECK(cudaGraphDestroy(graph));
    }
    print_differences(names, outs, "wait");
    return 0;
}

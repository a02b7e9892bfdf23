// Microbenchmark (not part of lily): a chain of dependent 4-bit mat-vecs, as decode runs them, in
// two structures, on the same dot code:
//   separate   one kernel per product, launched with programmatic dependent launch and replayed
//              as a CUDA graph (lily's structure): each block requests its first rows before
//              griddepcontrol.wait, stages x after it;
//   persistent one kernel for the whole chain, one block per SM; each block owns a slice of every
//              product's rows, which bulk copies (TMA) bring into a two-slot shared-memory ring
//              one product ahead, while the block waits on a flag counter for the previous
//              product's outputs;
//   persistent-noprefetch  the same, each slice copied only once its product's inputs are ready.
// The products alternate 8192 x 2048 and 2048 x 8192 (8 MB of 4-bit weights each, 40 of them:
// 320 MB, beyond L2), weights in 16-byte chunks of 32 nibbles, a half2 scale/bias per 64 values.
//   nvcc -O3 -arch=sm_90a -std=c++17 -o persistent_chain persistent_chain.cu && ./persistent_chain
#include "chain_common.cuh"

constexpr int LAYERS = 40;
constexpr int WIDE = 8192, NARROW = 2048;

// ---- separate kernels -------------------------------------------------------------------
constexpr int SEP_THREADS = 256, SEP_MAX_U = 8;

__global__ void __launch_bounds__(SEP_THREADS) separate_matvec(Layer l, const float* x, float* y) {
    extern __shared__ __align__(16) unsigned char smem[];
    uint4* xs = reinterpret_cast<uint4*>(smem);
    float* xsum = reinterpret_cast<float*>(smem + (size_t)l.cols / 32 * 64);
    const int lane = threadIdx.x & 31, warps = blockDim.x / 32;
    const int chunks = l.cols / 32, per_lane = chunks / 32;
    int row = blockIdx.x * warps + threadIdx.x / 32;
    const int stride = gridDim.x * warps;
    uint4 u[SEP_MAX_U];
    __half2 sb[SEP_MAX_U];
    if (row < l.rows) load_row(l, row, lane, u, sb);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
    stage_x(x, l.cols, xs, xsum);
    __syncthreads();
    for (; row < l.rows; row += stride) {
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < SEP_MAX_U; ++j)
            if (j < per_lane) {
                const int c = j * 32 + lane;
                acc += chunk_dot(u[j], xs, chunks, c, xsum[c], sb[j]);
            }
        acc = warp_sum(acc);
        if (lane == 0) y[row] = acc;
        const int next = row + stride;
        if (next < l.rows) load_row(l, next, lane, u, sb);
    }
}

// ---- persistent kernel --------------------------------------------------------------------
constexpr int PER_THREADS = 512;
constexpr int SLOT_BYTES = 72 * 1024;  // a block's slice of one product: rows and scales

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
}

struct Slice {
    int row0, rows;
};

__device__ __forceinline__ Slice slice_of(const Layer& l) {
    const int per = (l.rows + gridDim.x - 1) / gridDim.x;
    Slice s;
    s.row0 = min(l.rows, (int)blockIdx.x * per);
    s.rows = min(l.rows, s.row0 + per) - s.row0;
    return s;
}

// Copies `bytes` (a multiple of 16) in pieces of at most `piece` bytes, all counted by `bar`.
__device__ void bulk_copy_pieces(unsigned char* dst, const void* src, uint32_t bytes, uint32_t piece, uint64_t* bar) {
    const unsigned char* s = static_cast<const unsigned char*>(src);
    for (uint32_t o = 0; o < bytes; o += piece) bulk_copy(dst + o, s + o, min(piece, bytes - o), bar);
}

// Requests layer l's slice into `slot` (thread 0), in copies of at most `piece` bytes.
__device__ void request_slice(const Layer& l, unsigned char* slot, uint64_t* bar, uint32_t piece) {
    const Slice s = slice_of(l);
    const int chunks = l.cols / 32;
    const uint32_t wbytes = s.rows * chunks * 16, sbytes = s.rows * (chunks / 2) * 4;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(wbytes + sbytes)
                 : "memory");
    if (wbytes > 0) {
        bulk_copy_pieces(slot, l.w + (size_t)s.row0 * chunks, wbytes, piece, bar);
        bulk_copy_pieces(slot + wbytes, l.sb + (size_t)s.row0 * (chunks / 2), sbytes, piece, bar);
    }
}

__device__ __forceinline__ void wait_slot(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tWAIT_%=:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
        "@!p bra WAIT_%=;\n\t}" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}

__global__ void __launch_bounds__(PER_THREADS, 1)
    persistent_chain(const Layer* layers, int count, const float* x0, float* const* ys, unsigned* done, int mode) {
    // mode: bit 0 prefetch one product ahead; timing only (wrong results): bit 1 no dot, bit 2
    // no wait for the previous product, bit 3 a backoff between polls; bit 4 the slices copied in
    // pieces of 4 KB.
    const int prefetch = mode & 1;
    const uint32_t piece = mode & 16 ? 4096u : 1u << 30;  // bit 4: copies of 4 KB
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char* slots[2] = {smem, smem + SLOT_BYTES};
    uint4* xs = reinterpret_cast<uint4*>(smem + 2 * SLOT_BYTES);
    float* xsum = reinterpret_cast<float*>(smem + 2 * SLOT_BYTES + WIDE / 32 * 64);
    __shared__ __align__(8) uint64_t bars[2];
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    if (threadIdx.x == 0) {
        for (int i = 0; i < 2; ++i)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bars[i])) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0 && prefetch) {
        request_slice(layers[0], slots[0], &bars[0], piece);
        if (count > 1) request_slice(layers[1], slots[1], &bars[1], piece);
    }
    for (int i = 0; i < count; ++i) {
        const Layer l = layers[i];
        const float* x = i == 0 ? x0 : ys[i - 1];
        // The previous product's outputs: every block's counter arrival.
        if (i > 0 && threadIdx.x == 0 && !(mode & 4)) {
            unsigned seen;
            for (;;) {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(done + i - 1) : "memory");
                if (seen >= gridDim.x) break;
                if (mode & 8) __nanosleep(64);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0 && !prefetch) request_slice(l, slots[i & 1], &bars[i & 1], piece);
        stage_x(x, l.cols, xs, xsum);
        __syncthreads();
        wait_slot(&bars[i & 1], (i >> 1) & 1);
        const Slice s = slice_of(l);
        const int chunks = l.cols / 32;
        const uint4* w = reinterpret_cast<const uint4*>(slots[i & 1]);
        const __half2* sb = reinterpret_cast<const __half2*>(slots[i & 1] + (size_t)s.rows * chunks * 16);
        for (int r = warp; r < s.rows && !(mode & 2); r += warps) {
            float acc = 0.0f;
            for (int c = lane; c < chunks; c += 32)
                acc += chunk_dot(w[(size_t)r * chunks + c], xs, chunks, c, xsum[c], sb[(size_t)r * (chunks / 2) + c / 2]);
            acc = warp_sum(acc);
            if (lane == 0) ys[i][s.row0 + r] = acc;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(done + i, 1u);
            // The slot this product used is free: the product after next goes into it.
            if (prefetch && i + 2 < count) request_slice(layers[i + 2], slots[i & 1], &bars[i & 1], piece);
        }
    }
}

// ---- host ---------------------------------------------------------------------------------
int main() {
    int sms;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    std::vector<Layer> layers(LAYERS);
    size_t total_bytes = 0;
    for (int i = 0; i < LAYERS; ++i) {
        Layer& l = layers[i];
        l.rows = i % 2 == 0 ? WIDE : NARROW;
        l.cols = i % 2 == 0 ? NARROW : WIDE;
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
    float *x0;
    CHECK(cudaMalloc(&x0, WIDE * 4));
    std::vector<float> hx(WIDE);
    for (int i = 0; i < WIDE; ++i) hx[i] = std::sin(0.37f * i);
    CHECK(cudaMemcpy(x0, hx.data(), WIDE * 4, cudaMemcpyHostToDevice));
    std::vector<float*> ys_sep(LAYERS), ys_per(LAYERS);
    for (int i = 0; i < LAYERS; ++i) {
        CHECK(cudaMalloc(&ys_sep[i], WIDE * 4));
        CHECK(cudaMalloc(&ys_per[i], WIDE * 4));
    }
    cudaStream_t stream;
    CHECK(cudaStreamCreate(&stream));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    const int reps = 50;

    // Separate kernels, PDL, one graph.
    CHECK(cudaFuncSetAttribute(separate_matvec, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < LAYERS; ++i) {
        const Layer& l = layers[i];
        cudaLaunchConfig_t cfg = {};
        const int warps = SEP_THREADS / 32;
        cfg.gridDim = dim3(std::min(l.rows / warps, 3 * sms));
        cfg.blockDim = dim3(SEP_THREADS);
        cfg.dynamicSmemBytes = l.cols / 32 * 64 + l.cols / 32 * 4;
        cfg.stream = stream;
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        const float* x = i == 0 ? x0 : ys_sep[i - 1];
        CHECK(cudaLaunchKernelEx(&cfg, separate_matvec, l, x, ys_sep[i]));
    }
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaStreamSynchronize(stream));
    const double sep_us = replay_us(exec, stream, reps, e0, e1);
    printf("separate (PDL graph)     %8.1f us per chain, %6.2f us per product, %6.0f GB/s\n", sep_us, sep_us / LAYERS,
           total_bytes / (sep_us * 1e3));

    // Persistent.
    Layer* d_layers;
    float** d_ys;
    unsigned* done;
    CHECK(cudaMalloc(&d_layers, sizeof(Layer) * LAYERS));
    CHECK(cudaMalloc(&d_ys, sizeof(float*) * LAYERS));
    CHECK(cudaMalloc(&done, sizeof(unsigned) * LAYERS));
    CHECK(cudaMemcpy(d_layers, layers.data(), sizeof(Layer) * LAYERS, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_ys, ys_per.data(), sizeof(float*) * LAYERS, cudaMemcpyHostToDevice));
    const int smem = 2 * SLOT_BYTES + WIDE / 32 * 64 + WIDE / 32 * 4;
    CHECK(cudaFuncSetAttribute(persistent_chain, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const struct {
        int mode;
        const char* name;
    } modes[] = {{0, "no prefetch"}, {8, "no prefetch, backoff"}, {2, "no prefetch, no dot"},
                 {6, "no prefetch, no dot/wait"}, {3, "prefetch, no dot"}, {7, "prefetch, no dot/wait"},
                 {23, "prefetch, no dot/wait, 4K"}, {19, "prefetch, no dot, 4K"}, {17, "prefetch, 4K"},
                 {9, "prefetch, backoff"}, {1, "prefetch"}};
    for (const auto& m : modes) {
        double total = 0.0;
        for (int r = 0; r <= reps; ++r) {
            CHECK(cudaMemsetAsync(done, 0, sizeof(unsigned) * LAYERS, stream));
            CHECK(cudaEventRecord(e0, stream));
            persistent_chain<<<sms, PER_THREADS, smem, stream>>>(d_layers, LAYERS, x0, d_ys, done, m.mode);
            CHECK(cudaGetLastError());
            CHECK(cudaEventRecord(e1, stream));
            CHECK(cudaEventSynchronize(e1));
            float ms;
            CHECK(cudaEventElapsedTime(&ms, e0, e1));
            if (r > 0) total += ms;
        }
        const double per_us = total * 1e3 / reps;
        printf("persistent (%-24s) %8.1f us per chain, %6.2f us per product, %6.0f GB/s\n", m.name, per_us,
               per_us / LAYERS, total_bytes / (per_us * 1e3));
    }
    // Both structures compute the same chain.
    std::vector<float> a(NARROW), b(NARROW);
    CHECK(cudaMemcpy(a.data(), ys_sep[LAYERS - 1], NARROW * 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(b.data(), ys_per[LAYERS - 1], NARROW * 4, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    for (int i = 0; i < NARROW; ++i) {
        num = std::max(num, (double)std::fabs(a[i] - b[i]));
        den = std::max(den, (double)std::fabs(a[i]));
    }
    printf("last outputs: max |separate - persistent| = %.3e of max |separate| = %.3e\n", num, den);
    return 0;
}

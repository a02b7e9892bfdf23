// Microbenchmark (not part of lily): what a persistent decode kernel that streams every SM's
// coming weights into a deep shared-memory ring would buy over lily's separate kernels, on a
// chain of 40 dependent 4-bit mat-vecs with lily's own staging and integer dot:
//   lily        lily's `matvec` / `matvec_two_rows` (included from the kernel sources), launched
//               as lily launches them (up to three blocks per SM, programmatic dependent launch,
//               a CUDA graph);
//   stream      one kernel for the whole chain, one block per SM, which owns a contiguous slice
//               of every product's rows. A producer warp keeps the block's slices of the coming
//               products on their way into a ring of ~200 KB of shared memory (TMA bulk copies,
//               an mbarrier per product), as many products ahead as the ring holds; 256
//               consumer threads wait for each product's input (the previous product ended on
//               every block), stage it as lily's 256-thread blocks do (bit for bit), wait for
//               their slice and dot it from shared memory. How a product's end is made known:
//               a counter per product that every block bumps and thread 0 polls (acquire
//               loads), or a flag per product and block, thread b polling block b's;
//   routed      the same, but the slices of the products the second argument marks (bit j:
//               shape j of the list) are requested only once the product before the first of a
//               run of marked ones has ended: the routed experts' rows cannot be known before
//               the routing;
//   unstreamed  the same, every slice requested only once the previous product has ended
//               (what streaming ahead buys).
// (The first version, commit d018648, issued the copies from consumer thread 0 as room freed.
// docs/BENCHMARKS.md's numbers are from 66c6b31, before the shared helpers moved into
// lily_chain.cuh with the same arithmetic.)
// The stream modes also print where a product's time goes (globaltimer stamps per block, means
// over the products of each shape of the median block, from the previous product's last block to
// finish): slice issued, dependency seen, x staged, slice arrived, rows done. Products given as
// ROWSxCOLS,... (COLS 2048 or 4096; repeated to 40; each reads the first COLS outputs of the one
// before). The default list is a DeltaNet layer and its MoE: in_proj, a small product standing
// for the recurrent step, out_proj, the router, the routed gate/up, the routed down.
//   nvcc -O3 -arch=sm_90a -std=c++17 -o stream_chain scripts/microbench/stream_chain.cu
//   ./stream_chain 12352x2048,2048x2048,2048x4096,1024x2048,8192x2048,2048x4096 0x30
// Without a GPU, `nvcc -c` checks that it compiles (see cascade_chain.cu for the packages).
#include "lily_chain.cuh"

constexpr int PRODUCTS = 40;
constexpr int DEPTH = 16;          // products whose slices may be in flight at once (mbarriers)
constexpr int FLAG_STRIDE = 32;    // a product's counter every 128 bytes
constexpr int STAMPS = 5;          // per product and block: dependency, staged, slice, done, issued
constexpr int PIECE = 16384;       // bytes per bulk copy

struct Product {
    Weight w;
    const float* x;  // input: the previous product's output (or the chain's input)
    float* y;
    int dep;         // the last product whose end this one's slice must wait for (-1: none)
};

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__host__ __device__ inline uint32_t round16(uint32_t v) { return (v + 15u) & ~15u; }

// Bytes of a block's slice of w in the ring: rows, then scales, then biases (each 16-byte whole).
__host__ __device__ inline uint32_t slice_bytes(const Weight& w, int nrows) {
    return (uint32_t)nrows * (w.cols / 2) + 2u * round16((uint32_t)nrows * (w.cols / 64) * 2u);
}

constexpr int CONSUMERS = 256;           // threads that stage x and dot (as a lily block of 256)
constexpr int THREADS = CONSUMERS + 32;  // and one producer warp

// The ring's bookkeeping in shared memory. The producer writes start[] before a slice's copies
// (the consumers read it once the slice's mbarrier completes); the consumers' thread 0 counts
// the products whose slices are used up.
struct Ring {
    unsigned long long bars[DEPTH];
    unsigned long long start[DEPTH];  // where product i % DEPTH's slice begins (bytes, monotonic)
    int consumed;
};

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory"); }

// How blocks learn that a product has ended: one counter per product that every block bumps
// (FLAG_STRIDE apart; thread 0 polls it), or one flag per product and block (each in its own
// 128 bytes; thread b polls block b's), so that no line takes every block's atomics and polls.
struct Flags {
    unsigned* f;
    unsigned epoch;  // this replay's: (*step + 1)
    int per_block;
};

__device__ __forceinline__ bool product_ended(const Flags& fl, int i, int lane_or_thread, int stride) {
    if (!fl.per_block) return lane_or_thread != 0 || ld_acquire(fl.f + i * FLAG_STRIDE) >= fl.epoch * gridDim.x;
    bool ok = true;
    for (int b = lane_or_thread; b < (int)gridDim.x; b += stride)
        ok = ok && ld_acquire(fl.f + ((size_t)i * gridDim.x + b) * FLAG_STRIDE) >= fl.epoch;
    return ok;
}

__device__ __forceinline__ void signal_product(const Flags& fl, int i) {
    __threadfence();
    if (fl.per_block)
        asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(fl.f + ((size_t)i * gridDim.x + blockIdx.x) * FLAG_STRIDE),
                     "r"(fl.epoch)
                     : "memory");
    else
        atomicAdd(fl.f + i * FLAG_STRIDE, 1u);
}

// The producer warp: every product's slice in order, each once the slice DEPTH products back is
// used up (its mbarrier is free), its dependency has ended and the ring has room for it.
__device__ void produce(const Product* prods, Ring& ring, uint32_t ring_base, uint32_t ring_bytes, const Flags& fl,
                        unsigned long long* stamps) {
    const int lane = threadIdx.x & 31;
    unsigned long long head = 0;
    for (int j = 0; j < PRODUCTS; ++j) {
        const Product& p = prods[j];
        const Weight& w = p.w;
        const int r0 = resident_rows(w.rows, gridDim.x, blockIdx.x), r1 = resident_rows(w.rows, gridDim.x, blockIdx.x + 1);
        const uint32_t bytes = slice_bytes(w, r1 - r0);
        unsigned long long at = head;
        if (at % ring_bytes + bytes > ring_bytes) at += ring_bytes - at % ring_bytes;  // no wrap inside a slice
        for (;;) {
            const int c = *(volatile int*)&ring.consumed;
            // Room: the oldest slice still in use begins at start[c % DEPTH] (none: empty ring).
            const bool room = c == j || at + bytes - *(volatile unsigned long long*)&ring.start[c % DEPTH] <= ring_bytes;
            if (c > j - DEPTH && room) break;
        }
        if (p.dep >= 0)
            while (!__all_sync(0xffffffffu, product_ended(fl, p.dep, lane, 32))) {}
        if (lane == 0) {
            const uint32_t bar = shared_address(&ring.bars[j % DEPTH]);
            *(volatile unsigned long long*)&ring.start[j % DEPTH] = at;
            mbar_expect_tx(bar, bytes);
            const uint32_t dst = ring_base + (uint32_t)(at % ring_bytes);
            const uint32_t wbytes = (uint32_t)(r1 - r0) * (w.cols / 2), sbytes = (uint32_t)(r1 - r0) * (w.cols / 64) * 2;
            const char* src = static_cast<const char*>(w.data) + (size_t)r0 * (w.cols / 2);
            for (uint32_t off = 0; off < wbytes; off += PIECE)
                bulk_to_shared(dst + off, src + off, min((uint32_t)PIECE, wbytes - off), bar);
            bulk_to_shared(dst + wbytes, w.scales + (size_t)r0 * (w.cols / 64), sbytes, bar);
            bulk_to_shared(dst + wbytes + round16(sbytes), w.biases + (size_t)r0 * (w.cols / 64), sbytes, bar);
            stamps[((size_t)j * gridDim.x + blockIdx.x) * STAMPS + 4] = now_ns();
        }
        head = at + bytes;
        __syncwarp();
    }
}

// lily's stage<4, 256> (bit for bit) by the consumer threads only, their own barrier instead of
// the block's.
__device__ float stage_consumers(const float* x, int cols, const float* norm_scale, float eps, float* xs,
                                 float* scratch) {
    const StageSource src = {x, 0, cols, 1, nullptr};
    const int words = cols / 8;
    float ss = 0.0f;
    for (int t = threadIdx.x; t < ((words + 31) & ~31); t += CONSUMERS) {
        float e[8] = {};
        if (t < words) source_eight(src, norm_scale, 8 * t, e, ss);
        stage_word<4>(t, t < words, cols, e, xs);
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = ss;
    consumers_sync();
    float total = 0.0f;
    for (int w = 0; w < CONSUMERS / 32; ++w) total += scratch[w];
    return rsqrtf(total / cols + eps);
}

// The whole chain in one launch (one block per SM): CONSUMERS threads that wait for each
// product's input, stage it and dot the block's slice, and a producer warp that keeps the coming
// slices on their way (produce). Flags only grow; this replay's epoch is *step + 1. Shared
// memory: x staged, 64 floats of scratch, then the ring of ring_bytes.
__global__ void __launch_bounds__(THREADS, 1) chain_stream(const Product* prods, const float* norm_scale, float eps,
                                                           unsigned* flag_words, int per_block, const unsigned* step,
                                                           uint32_t ring_bytes, unsigned long long* stamps,
                                                           unsigned long long* chain_time) {
    extern __shared__ __align__(16) float smem[];
    __shared__ Ring ring;
    float* xs = smem;
    float* scratch = xs + staged_floats(4096);
    const uint32_t ring_base = shared_address(scratch + 64);
    const unsigned long long t_start = now_ns();
    const Flags fl = {flag_words, *(volatile const unsigned*)step + 1u, per_block};
    if (threadIdx.x == 0) {
        for (int i = 0; i < DEPTH; ++i) mbar_init(shared_address(&ring.bars[i]), 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        ring.consumed = 0;
    }
    __syncthreads();
    if (threadIdx.x >= CONSUMERS) {
        produce(prods, ring, ring_base, ring_bytes, fl, stamps);
        return;
    }
    for (int i = 0; i < PRODUCTS; ++i) {
        const Product& p = prods[i];
        if (i > 0) {
            while (!product_ended(fl, i - 1, threadIdx.x, CONSUMERS)) {}
            consumers_sync();
        }
        const unsigned long long t1 = now_ns();
        const float inv = stage_consumers(p.x, p.w.cols, norm_scale, eps, xs, scratch);
        const unsigned long long t2 = now_ns();
        const int r0 = resident_rows(p.w.rows, gridDim.x, blockIdx.x), r1 = resident_rows(p.w.rows, gridDim.x, blockIdx.x + 1);
        mbar_wait(shared_address(&ring.bars[i % DEPTH]), (i / DEPTH) & 1);
        const unsigned long long t3 = now_ns();
        const uint32_t ws = ring_base + (uint32_t)(*(volatile unsigned long long*)&ring.start[i % DEPTH] % ring_bytes);
        const int nrows = r1 - r0, cols = p.w.cols, warp = threadIdx.x >> 5;
        const uint32_t ss = ws + nrows * (cols / 2), bs = ss + round16(nrows * (cols / 64) * 2);
        if (cols == 2048) {
            HeldX<2> held;
            hold_x(xs, cols, held);
            dot_resident_rows(cols, nrows, ws, ss, bs, held, inv, p.y + r0, warp, CONSUMERS / 32);
        } else {
            HeldX<4> held;
            hold_x(xs, cols, held);
            dot_resident_rows(cols, nrows, ws, ss, bs, held, inv, p.y + r0, warp, CONSUMERS / 32);
        }
        consumers_sync();
        if (threadIdx.x == 0) {
            signal_product(fl, i);
            *(volatile int*)&ring.consumed = i + 1;
            unsigned long long* s = stamps + ((size_t)i * gridDim.x + blockIdx.x) * STAMPS;
            s[0] = t1, s[1] = t2, s[2] = t3, s[3] = now_ns();
        }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        while (!product_ended(fl, PRODUCTS - 1, 0, 1)) {}
        *chain_time += now_ns() - t_start;
    }
}

// The last launch of a replay: the next replay's counters' target.
__global__ void bump_step(unsigned* step) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    *step += 1;
}

int main(int argc, char** argv) {
    const char* spec = argc > 1 ? argv[1] : "12352x2048,2048x2048,2048x4096,1024x2048,8192x2048,2048x4096";
    const unsigned routed_shapes = argc > 2 ? (unsigned)strtoul(argv[2], nullptr, 0) : 0x30u;
    std::vector<std::pair<int, int>> shapes;
    if (!parse_shapes(spec, shapes)) return 1;
    int sms, max_smem;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    Chain chain;
    if (!make_chain(shapes, PRODUCTS, chain)) return 1;
    const std::vector<Weight>& layers = chain.layers;
    const std::vector<float*>& ys = chain.ys;
    float *x0 = chain.x0, *norm = chain.norm;
    const size_t total_bytes = chain.total_bytes;
    const int ring_bytes = (max_smem - (int)sizeof(Ring) - (staged_floats(4096) + 64) * 4 - 256) & ~1023;
    for (int i = 0; i < PRODUCTS; ++i) {
        const Weight& l = layers[i];
        const int most = resident_rows(l.rows, sms, sms) - resident_rows(l.rows, sms, sms - 1) + 1;
        if ((int)slice_bytes(l, most) > ring_bytes) {
            printf("product %d: a block's slice of %dx%d does not fit the %d-byte ring\n", i, l.rows, l.cols, ring_bytes);
            return 1;
        }
    }
    unsigned *flags, *step;
    const size_t flag_bytes = (size_t)PRODUCTS * sms * FLAG_STRIDE * 4;
    CHECK(cudaMalloc(&flags, flag_bytes));
    CHECK(cudaMalloc(&step, 4));
    unsigned long long *stamps, *chain_time;
    CHECK(cudaMalloc(&stamps, (size_t)PRODUCTS * sms * STAMPS * 8));
    CHECK(cudaMalloc(&chain_time, 8));
    Product* prods;
    CHECK(cudaMalloc(&prods, PRODUCTS * sizeof(Product)));
    const size_t stream_smem = (size_t)(staged_floats(4096) + 64) * 4 + ring_bytes;
    CHECK(cudaFuncSetAttribute(chain_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)stream_smem));
    cudaStream_t stream;
    CHECK(cudaStreamCreate(&stream));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    const float eps = 1e-6f;
    const int reps = 200;
    printf("%d SMs, ring %d bytes per block, chain %s (%.1f MB), routed shapes 0x%x\n", sms, ring_bytes, spec,
           total_bytes / 1e6, routed_shapes);

    // Modes: 0 lily; then stream, routed, unstreamed with a counter per product; the same with a
    // flag per product and block.
    const char* names[] = {"lily matvec",        "stream, counter",     "routed, counter", "unstreamed, counter",
                           "stream, flag/block", "routed, flag/block", "unstreamed, flag/block"};
    const int modes = 7;
    std::vector<std::vector<float>> outs;
    for (int mode = 0; mode < modes; ++mode) {
        const int kind = mode == 0 ? -1 : (mode - 1) % 3;  // 0 stream, 1 routed, 2 unstreamed
        const int per_block = mode >= 4;
        CHECK(cudaMemset(flags, 0, flag_bytes));
        CHECK(cudaMemset(step, 0, 4));
        std::vector<Product> hp(PRODUCTS);
        for (int i = 0; i < PRODUCTS; ++i) {
            hp[i] = {layers[i], i == 0 ? x0 : ys[i - 1], ys[i], -1};
            if (kind == 2) hp[i].dep = i - 1;
            if (kind == 1 && (routed_shapes >> (i % shapes.size()) & 1u)) {
                int d = i - 1;
                while (d >= 0 && (routed_shapes >> (d % shapes.size()) & 1u)) --d;
                hp[i].dep = d;
            }
        }
        CHECK(cudaMemcpy(prods, hp.data(), hp.size() * sizeof(Product), cudaMemcpyHostToDevice));
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        if (mode == 0) {
            cudaLaunchAttribute attr;
            attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
            attr.val.programmaticStreamSerializationAllowed = 1;
            for (int i = 0; i < PRODUCTS; ++i) {
                const Weight& l = layers[i];
                const float* x = i == 0 ? x0 : ys[i - 1];
                cudaLaunchConfig_t cfg = {};
                cfg.stream = stream;
                cfg.attrs = &attr;
                cfg.numAttrs = 1;
                const int r = l.cols <= 2048 ? 2 : 1;
                cfg.gridDim = dim3(std::min((l.rows + 8 * r - 1) / (8 * r), 3 * sms));
                cfg.blockDim = dim3(256);
                cfg.dynamicSmemBytes = (64 + staged_floats(l.cols)) * 4;
                const float* no_add = nullptr;
                if (r == 2)
                    CHECK(cudaLaunchKernelEx(&cfg, matvec_two_rows, l, x, (const float*)norm, eps, ys[i], no_add));
                else
                    CHECK(cudaLaunchKernelEx(&cfg, matvec, l, x, (const float*)norm, eps, ys[i], no_add));
            }
        } else {
            chain_stream<<<sms, THREADS, stream_smem, stream>>>(prods, norm, eps, flags, per_block, step,
                                                                 (uint32_t)ring_bytes, stamps, chain_time);
            CHECK(cudaGetLastError());
            bump_step<<<1, 1, 0, stream>>>(step);
        }
        CHECK(cudaStreamEndCapture(stream, &graph));
        CHECK(cudaGraphInstantiate(&exec, graph, 0));
        for (int r = 0; r < 10; ++r) CHECK(cudaGraphLaunch(exec, stream));
        CHECK(cudaStreamSynchronize(stream));
        CHECK(cudaMemset(chain_time, 0, 8));
        const double us = replay_us(exec, stream, reps, e0, e1);
        printf("%-18s %8.1f us per chain, %6.2f us per product, %6.0f GB/s", names[mode], us, us / PRODUCTS,
               total_bytes / (us * 1e3));
        if (mode > 0) {
            unsigned long long t;
            CHECK(cudaMemcpy(&t, chain_time, 8, cudaMemcpyDeviceToHost));
            printf("  (the kernel itself %.2f us per product)", t / 1e3 / reps / PRODUCTS);
            // Per shape, means over its products after the first of the median block's stamps
            // (and the last block's end), from the previous product's last block to finish.
            std::vector<unsigned long long> st((size_t)PRODUCTS * sms * STAMPS);
            CHECK(cudaMemcpy(st.data(), stamps, st.size() * 8, cudaMemcpyDeviceToHost));
            const int kinds = (int)shapes.size();
            std::vector<std::vector<double>> ph(kinds, std::vector<double>(STAMPS + 1, 0.0));
            std::vector<int> n(kinds, 0);
            unsigned long long prev_end = 0;
            for (int i = 0; i < PRODUCTS; ++i) {
                std::vector<unsigned long long> v[STAMPS];
                for (int b = 0; b < sms; ++b)
                    for (int k = 0; k < STAMPS; ++k) v[k].push_back(st[((size_t)i * sms + b) * STAMPS + k]);
                for (int k = 0; k < STAMPS; ++k) std::sort(v[k].begin(), v[k].end());
                if (i > 0) {
                    std::vector<double>& q = ph[i % kinds];
                    for (int k = 0; k < STAMPS; ++k) q[k] += ((double)v[k][sms / 2] - (double)prev_end) / 1e3;
                    q[STAMPS] += ((double)v[3].back() - (double)prev_end) / 1e3;
                    n[i % kinds]++;
                }
                prev_end = v[3].back();
            }
            for (int k = 0; k < kinds; ++k) {
                const double m = n[k] ? 1.0 / n[k] : 0.0;
                printf("\n    %dx%d: issued %.2f, dependency seen %.2f, staged %.2f, slice %.2f, done %.2f / last %.2f",
                       shapes[k].first, shapes[k].second, ph[k][4] * m, ph[k][0] * m, ph[k][1] * m, ph[k][2] * m,
                       ph[k][3] * m, ph[k][STAMPS] * m);
            }
        }
        printf("\n");
        std::vector<float> h(layers[PRODUCTS - 1].rows);
        CHECK(cudaMemcpy(h.data(), ys[PRODUCTS - 1], h.size() * 4, cudaMemcpyDeviceToHost));
        outs.push_back(h);
        CHECK(cudaGraphExecDestroy(exec));
        CHECK(cudaGraphDestroy(graph));
    }
    print_differences(names, outs, "lily");
    return 0;
}

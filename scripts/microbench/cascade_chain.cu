// Microbenchmark (not part of lily): two ways of getting a decode kernel's weights on their way
// before the kernel can run, on a chain of 40 dependent 4-bit mat-vecs (x RMS-normalised on
// the way, as in lily), against lily's own kernels on the same random weights:
//   lily        lily's `matvec` / `matvec_two_rows` (included from the kernel sources), launched
//               as lily launches them (up to three persistent blocks per SM, programmatic
//               dependent launch, a CUDA graph);
//   resident    one block per SM, its contiguous slice of rows (weights, scales, biases) copied
//               into shared memory by TMA bulk copies at its start, x staged by lily's stage()
//               and each lane's chunks of it kept in registers for all of its rows;
//                 late:  launch_dependents after the wait (as lily);
//                 early: launch_dependents at the start, so that the next kernels' blocks become
//                        resident as soon as shared memory allows and start their copies;
//                 2/SM:  early, twice the blocks with half the rows each;
//                 cp.async: late or early, the slice copied by every thread with 16-byte
//                        cp.async (LDGSTS, through the load path) instead of TMA bulk copies;
//   streamer    lily's kernels, each marking in a counter that it has started, and beside them
//               (a branch of the same graph) a kernel of 32 blocks that asks L2 for the weights
//               of the next 1, 2 or 4 products (cp.async.bulk.prefetch.L2, 32 KB pieces), all at
//               once or paced at 1, 2 or 3 TB/s (so that the prefetches fill the time the chain
//               leaves DRAM idle instead of arriving in one burst beside its reads), or as many
//               bytes of a buffer the chain never reads (the traffic without its hits), or of
//               that buffer's first 4 MB again and again (the prefetches without DRAM traffic);
//   copier      the same side kernel moving the bytes by TMA copies into a shared buffer instead
//               (other bytes; the next product's weights, at once or paced at 2 TB/s);
//   loader      8 whole-SM blocks reading the next product's weights (or other bytes) with
//               plain loads; and the same blocks loading nothing (what taking 8 SMs costs);
//   throttled   the copier as 4, 16 or 64 threads (as many 32 KB copies in flight);
//               and the same branch with a kernel that exits at once, or only polls the counter;
//   warmer      the chain's grids sized for WARM_BLOCKS fewer SMs, and on those SMs (a block each,
//               holding most of the SM's shared memory so that no chain block lands there) plain
//               loads of the next 1-2 products' weights into L2, skipping products it has fallen
//               behind: of the products the third argument marks (bit j: shape j of the list; the
//               routed experts' rows, say, cannot be read before their routing) or of all; and
//               the same SMs taken with nothing loaded. Does a warmer that stays ahead pay for its SMs?
// Modes with a side branch also print the chain's own time, from its first launch to its last
// product's end: the graph's time waits for the side branch too, which may end later (and in
// every streamer mode measured, does: docs/BENCHMARKS.md, "What a redesign would buy").
// The resident modes print where their time goes (globaltimer stamps per block) and how their
// blocks were placed. Products given as ROWSxCOLS,... (COLS 2048 or 4096; repeated to 40; each
// reads the first COLS outputs of the one before); an optional second argument masks the modes
// (bit i: mode i, in the order printed).
//   nvcc -O3 -arch=sm_90a -std=c++17 -o cascade_chain scripts/microbench/cascade_chain.cu
//   ./cascade_chain 12352x2048,2048x4096 [MODES [WARMED_SHAPES]]
// (0xc000000f: lily and the resident kernels, TMA and cp.async; 0x3fe0031: lily, the prefetcher, the copiers, the loaders and the throttled copiers;
// 0x3c000010: lily marked and the warmers, e.g. with shapes 12352x2048,2048x2048,2048x4096,
// 1024x2048,8192x2048,2048x4096 and the third argument 0xd). Without
// a GPU, `nvcc -c` checks that it compiles: pip-install nvidia-cuda-nvcc, nvidia-cuda-crt,
// nvidia-cuda-cccl, nvidia-cuda-runtime and nvidia-nvvm, all 13.0.*, and pass
// -I$C/include -I$C/include/cccl with C = site-packages/nvidia/cu13.
#include "lily_chain.cuh"

constexpr int PRODUCTS = 40;
#ifndef RES_THREADS
#define RES_THREADS 256
#endif

// Shared memory: the block's rows (weights, scales, biases), then x staged as lily stages it,
// then 64 floats of scratch. stamps (non-null): per block, globaltimer at start, after the wait,
// after staging, after its weights arrived, at the end.
template <int CPL>
__global__ void __launch_bounds__(RES_THREADS) matvec_resident(Weight w, const float* x, const float* norm_scale,
                                                               float eps, float* y, int early, int ldgsts, int* smlog,
                                                               unsigned long long* stamps) {
    extern __shared__ __align__(16) float smem[];
    __shared__ __align__(8) unsigned long long bar_storage;
    const unsigned long long t0 = now_ns();
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int r0 = resident_rows(w.rows, gridDim.x, blockIdx.x), r1 = resident_rows(w.rows, gridDim.x, blockIdx.x + 1);
    const int nrows = r1 - r0;
    const int row_bytes = w.cols / 2, groups = w.cols / 64;
    const uint32_t ws = shared_address(smem);
    const uint32_t ss = ws + nrows * row_bytes;
    const uint32_t bs = ss + nrows * groups * 2;
    float* xs = smem + (nrows * (row_bytes + groups * 4)) / 4;
    float* scratch = xs + staged_floats(w.cols);
    const uint32_t bar = shared_address(&bar_storage);
    if (threadIdx.x == 0 && smlog != nullptr) {
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        smlog[blockIdx.x] = (int)sm;
    }
    if (ldgsts) {
        // The weights, scales and biases in 16-byte pieces over every thread.
        const uint32_t wbytes = nrows * row_bytes, sbytes = nrows * groups * 2;
        const char* srcs[3] = {static_cast<const char*>(w.data) + (size_t)r0 * row_bytes,
                               reinterpret_cast<const char*>(w.scales + (size_t)r0 * groups),
                               reinterpret_cast<const char*>(w.biases + (size_t)r0 * groups)};
        const uint32_t dsts[3] = {ws, ss, bs}, sizes[3] = {wbytes, sbytes, sbytes};
#pragma unroll
        for (int k = 0; k < 3; ++k)
            for (uint32_t off = threadIdx.x * 16u; off < sizes[k]; off += blockDim.x * 16u)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dsts[k] + off), "l"(srcs[k] + off)
                             : "memory");
        asm volatile("cp.async.commit_group;" ::: "memory");
    } else if (threadIdx.x == 0) {
        mbar_init(bar, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        const uint32_t wbytes = nrows * row_bytes, sbytes = nrows * groups * 2;
        mbar_expect_tx(bar, wbytes + 2 * sbytes);
        const char* src = static_cast<const char*>(w.data) + (size_t)r0 * row_bytes;
        for (uint32_t off = 0; off < wbytes; off += 16384) bulk_to_shared(ws + off, src + off, min(16384u, wbytes - off), bar);
        bulk_to_shared(ss, w.scales + (size_t)r0 * groups, sbytes, bar);
        bulk_to_shared(bs, w.biases + (size_t)r0 * groups, sbytes, bar);
    }
    __syncthreads();
    if (early) asm volatile("griddepcontrol.launch_dependents;" :::);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const unsigned long long t1 = now_ns();
    if (!early) asm volatile("griddepcontrol.launch_dependents;" :::);
    const StageSource src = {x, 0, w.cols, 1, nullptr};
    const float inv = stage<4>(src, norm_scale, eps, xs, scratch);
    HeldX<CPL> held;
    hold_x(xs, w.cols, held);
    const unsigned long long t2 = now_ns();
    if (ldgsts) {
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();
    } else {
        mbar_wait(bar, 0);
    }
    const unsigned long long t3 = now_ns();
    dot_resident_rows(w.cols, nrows, ws, ss, bs, held, inv, y + r0, warp, warps);
    if (stamps != nullptr) {
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned long long* s = stamps + blockIdx.x * 5;
            s[0] = t0, s[1] = t1, s[2] = t2, s[3] = t3, s[4] = now_ns();
        }
    }
}


// lily's mat-vecs with a progress mark: block 0 records that product `index` has started (so
// every product before index - 1 has finished) for the streamer below.
__device__ __forceinline__ void mark_progress(unsigned* progress, const unsigned* step, unsigned index) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        const unsigned value = *(volatile const unsigned*)step * 64u + index;
        asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(progress), "r"(value) : "memory");
    }
}
extern "C" __global__ void __launch_bounds__(256, 3) matvec_two_rows_marked(Weight w, const float* x, const float* norm_scale,
                                                                         float eps, float* y, unsigned* progress,
                                                                         const unsigned* step, unsigned mark) {
    extern __shared__ __align__(16) float smem[];
    mark_progress(progress, step, mark);
    matvec_bits<2, 2>(w, x, norm_scale, eps, y, nullptr, smem, blockIdx.x, gridDim.x);
}
extern "C" __global__ void __launch_bounds__(256, 3) matvec_marked(Weight w, const float* x, const float* norm_scale,
                                                                float eps, float* y, unsigned* progress, const unsigned* step, unsigned mark) {
    extern __shared__ __align__(16) float smem[];
    mark_progress(progress, step, mark);
    matvec_bits<1, 4>(w, x, norm_scale, eps, y, nullptr, smem, blockIdx.x, gridDim.x);
}

// The first launch of a replay with marks: when the chain starts (t[0]), once `need` side blocks
// have checked in at `ready` (the warmer's: placed before the chain's blocks fill the SMs).
__global__ void chain_start(unsigned long long* t, unsigned* ready, unsigned need) {
    if (need) {
        while (*(volatile unsigned*)ready < need) __nanosleep(100);
        *ready = 0;
    }
    t[0] = now_ns();
}

// The last launch of a replay: bumps the replay counter and adds the chain's own time (from
// chain_start to the last product's end) to t[1]: the graph's time also waits for the side
// branch, which may end later than the chain.
__global__ void bump_step(unsigned* step, unsigned long long* t) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    *step += 1;
    t[1] += now_ns() - t[0];
}

struct Range {
    const char* p;
    unsigned bytes;
};

// How far a streamer beside the chain may go: polls the chain's marks (base: this replay's)
// until products issued .. until - 1 may go out, `ahead` past the latest one started, and returns
// `until`; a polling-only streamer (ahead < 0) gets -1 once the last product has started.
// The latest product of this replay (base: its marks) to have started, -1 before the first.
__device__ __forceinline__ int latest_started(const unsigned* progress, unsigned base) {
    unsigned seen;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(progress) : "memory");
    return seen >= base && seen < base + 64u ? (int)(seen - base) : -1;
}

__device__ int products_to_issue(const unsigned* progress, unsigned base, int products, int ahead, int issued) {
    for (;;) {
        const int started = latest_started(progress, base);
        if (ahead < 0) {
            if (started == products - 1) return -1;
        } else {
            const int until = min(products, started + 1 + ahead);
            if (until > issued) return until;
        }
        __nanosleep(200);
    }
}

// Runs beside the chain (its own branch of the graph): asks L2 for the weights of every product
// up to `ahead` past the latest one started, each range split over the streamer's blocks in
// pieces of at most 32 KB. ranges[3 i .. 3 i + 2]: product i's weights, scales, biases.
// copy: TMA bulk copies into a 32 KB shared buffer (contents discarded) instead of L2 prefetches,
// each thread with one copy in flight, tracked by its own mbarrier.
__global__ void stream_weights(const Range* ranges, int products, int ahead, unsigned pace, unsigned wrap, int copy,
                               const unsigned* step, const unsigned* progress) {
    extern __shared__ __align__(128) unsigned char sink[];
    __shared__ __align__(8) unsigned long long bars[1024];
    const uint32_t bar = shared_address(&bars[threadIdx.x]);
    uint32_t parity = 0;
    bool pending = false;
    if (copy) {
        mbar_init(bar, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const unsigned base = *(volatile const unsigned*)step * 64u;
    int issued = 0;
    while (issued < products) {
        const int until = products_to_issue(progress, base, products, ahead, issued);
        if (until < 0) return;
        for (; issued < until; ++issued) {
            // Paced: the piece at byte offset o of the product (its three ranges one after
            // another) goes out no earlier than o / pace after the product's first piece.
            const unsigned long long t0 = now_ns();
            unsigned long long before = 0;
            for (int k = 0; k < 3; ++k) {
                const Range r = ranges[3 * issued + k];
                // Piece j of the range: 32 KB pieces dealt over blocks and threads.
                const unsigned pieces = (r.bytes + 32767u) / 32768u;
                for (unsigned j = blockIdx.x * blockDim.x + threadIdx.x; j < pieces; j += gridDim.x * blockDim.x) {
                    const unsigned off = j * 32768u, n = min(32768u, r.bytes - off);
                    if (pace)
                        while (now_ns() < t0 + (before + off) / pace) __nanosleep(100);
                    // wrap: every piece from the first `wrap` bytes of the first range (pieces
                    // that stay in L2).
                    const char* at = wrap ? ranges[0].p + (((before + off) % wrap) & ~32767ull) : r.p + off;
                    if (copy) {
                        if (pending) {
                            mbar_wait(bar, parity);
                            parity ^= 1;
                        }
                        mbar_expect_tx(bar, n);
                        bulk_to_shared(shared_address(sink), at, n, bar);
                        pending = true;
                    } else {
                        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(at), "r"(n) : "memory");
                    }
                }
                before += r.bytes;
            }
        }
    }
    if (pending) mbar_wait(bar, parity);
}

// Reads product i's weights, scales and biases with plain loads (ld.global.cg: into L2, not L1)
// over every thread of the grid, 16 bytes per load, 8 in flight per thread; returns them folded
// (for the caller to keep the loads).
__device__ unsigned load_product(const Range* ranges, int i) {
    const unsigned threads = gridDim.x * blockDim.x, me = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned acc = 0;
    for (int k = 0; k < 3; ++k) {
        const Range r = ranges[3 * i + k];
        const uint4* p = reinterpret_cast<const uint4*>(r.p);
        const unsigned units = r.bytes / 16;
        for (unsigned u = me; u < units; u += 8 * threads) {
            uint4 v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const unsigned at = u + j * threads;
                v[j] = at < units ? __ldcg(p + at) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
        }
    }
    return acc;
}

// The same beside the chain with plain loads (load_product), for the question stream_weights
// leaves open: does ordinary read traffic of that volume stretch the chain too? LOADER_BLOCKS
// blocks of 1,024 threads (whole SMs: plain loads need warps to keep bytes in flight). A
// negative `ahead` loads nothing (the SMs taken, no traffic).
#define LOADER_BLOCKS 8
__global__ void __launch_bounds__(1024) stream_loads(const Range* ranges, int products, int ahead, const unsigned* step,
                                                     const unsigned* progress, unsigned* sink) {
    const unsigned base = *(volatile const unsigned*)step * 64u;
    unsigned acc = 0;
    int issued = 0;
    while (issued < products) {
        const int until = products_to_issue(progress, base, products, ahead, issued);
        if (until < 0) break;
        for (; issued < until; ++issued) acc ^= load_product(ranges, issued);
    }
    if (acc == 0x12345678u) *sink = acc;  // keeps the loads
}

// The warmer: WARM_BLOCKS blocks of 1,024 threads, one per SM (the launch asks for most of the
// SM's shared memory), loading (load_product) the weights of the products after the latest one
// started, up to `ahead` past it, that `warmed` marks (bit i % shapes of product i); products it
// has fallen behind are skipped, not loaded late. A negative `ahead` loads nothing until the
// last product has started.
#define WARM_BLOCKS 16
__global__ void __launch_bounds__(1024) warm_l2(const Range* ranges, int products, int ahead, unsigned warmed, int shapes,
                                                const unsigned* step, const unsigned* progress, unsigned* ready,
                                                unsigned* sink) {
    if (threadIdx.x == 0) atomicAdd(ready, 1u);
    const unsigned base = *(volatile const unsigned*)step * 64u;
    unsigned acc = 0;
    int next = 0;
    for (;;) {
        const int started = latest_started(progress, base);
        if (started == products - 1) break;
        const int until = ahead < 0 ? 0 : min(products, started + 1 + ahead);
        next = max(next, started + 1);
        if (next >= until) {
            __nanosleep(100);
            continue;
        }
        for (; next < until; ++next)
            if (warmed >> (next % shapes) & 1u) acc ^= load_product(ranges, next);
    }
    if (acc == 0x12345678u) *sink = acc;  // keeps the loads
}

int main(int argc, char** argv) {
    const char* spec = argc > 1 ? argv[1] : "12352x2048,2048x4096";
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
    int* smlog;
    CHECK(cudaMalloc(&smlog, PRODUCTS * 1024 * 4));
    unsigned long long* stamps;
    CHECK(cudaMalloc(&stamps, PRODUCTS * 1024 * 5 * 8));
    cudaStream_t stream;
    CHECK(cudaStreamCreate(&stream));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    CHECK(cudaFuncSetAttribute(matvec_resident<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem - 1024));
    CHECK(cudaFuncSetAttribute(matvec_resident<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem - 1024));
    const float eps = 1e-6f;
    const int reps = 200;
    // mode: 0 lily; 1 resident late; 2 resident early; 3 resident early, two blocks per SM.
    const char* names[] = {"lily matvec", "resident, late", "resident, early", "resident, early, 2/SM",
                           "lily, marked, no streamer", "lily + L2 streamer, 1 ahead", "lily + L2 streamer, 2 ahead",
                           "lily + L2 streamer, 4 ahead", "lily + empty side kernel", "lily + polling side kernel",
                           "streamer 1 ahead, 1 TB/s", "streamer 1 ahead, 2 TB/s", "streamer 1 ahead, 3 TB/s",
                           "streamer of other bytes", "streamer of other bytes, 1 TB/s",
                           "streamer of 4 MB again", "streamer of 4 MB again, 1 TB/s",
                           "copier of other bytes", "copier 1 ahead", "copier 1 ahead, 2 TB/s",
                           "loader SMs taken, no loads", "loader 1 ahead", "loader of other bytes",
                           "copier, 4 copies in flight", "copier, 16 in flight", "copier, 64 in flight",
                           "warmer SMs taken, no loads", "warmer of marked, 2 ahead", "warmer of all, 2 ahead",
                           "warmer of marked, 1 ahead", "resident, late, cp.async", "resident, early, cp.async"};
    const int modes = 32;
    const int aheads[] = {0, 0, 0, 0, 0, 1, 2, 4, 0, -1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, -1, 1, 1, 1, 1, 1, -1, 2, 2, 1, 0, 0};
    // Paced streamers: prefetched bytes per ns (1,000 = 1 TB/s); 0: all at once.
    const unsigned paces[] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1000, 2000, 3000, 0, 1000, 0, 1000, 0, 0, 2000, 0, 0, 0, 0, 0, 0,
                              0, 0, 0, 0, 0, 0};
    // Modes from 13 prefetch as many bytes per product from a buffer the chain never reads:
    // the cost of the traffic alone, without its hits; from 15 always its first 4 MB (after
    // the first pass L2 hits: the prefetch instructions' cost without the DRAM traffic).
    // Modes from 17 copy with TMA into shared memory instead (17: other bytes, 18-19: the
    // weights of the next product).
    // Modes from 20 run stream_loads instead (22: other bytes).
    // Modes 23-25 copy the next product's weights with at most 4, 16 or 64 copies in flight.
    // Modes from 26 run warm_l2 on WARM_BLOCKS SMs, the chain's grids sized for the others.
    const int other_bytes_from = 13, wrap_from = 15, copy_from = 17, loads_from = 20, throttled_from = 23,
              warm_from = 26, ldgsts_from = 30;
    const unsigned all_shapes = (1u << shapes.size()) - 1;
    const unsigned warmed = argc > 3 ? (unsigned)strtoul(argv[3], nullptr, 0) : all_shapes;
    CHECK(cudaFuncSetAttribute(warm_l2, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem));
    unsigned *sink, *ready;
    CHECK(cudaMalloc(&sink, 4));
    CHECK(cudaMalloc(&ready, 4));
    CHECK(cudaMemset(ready, 0, 4));
    unsigned long long* chain_time;
    CHECK(cudaMalloc(&chain_time, 2 * sizeof(unsigned long long)));
    unsigned *step, *progress;
    CHECK(cudaMalloc(&step, 4));
    CHECK(cudaMalloc(&progress, 4));
    CHECK(cudaMemset(step, 0, 4));
    CHECK(cudaMemset(progress, 0xff, 4));
    std::vector<Range> hranges;
    for (const Weight& l : layers) {
        const size_t groups = (size_t)l.rows * l.cols / 64;
        hranges.push_back({(const char*)l.data, (unsigned)((size_t)l.rows * l.cols / 2)});
        hranges.push_back({(const char*)l.scales, (unsigned)(groups * 2)});
        hranges.push_back({(const char*)l.biases, (unsigned)(groups * 2)});
    }
    Range* ranges;
    CHECK(cudaMalloc(&ranges, hranges.size() * sizeof(Range)));
    CHECK(cudaMemcpy(ranges, hranges.data(), hranges.size() * sizeof(Range), cudaMemcpyHostToDevice));
    size_t other_total = 0;
    for (const Range& r : hranges) other_total += (r.bytes + 255) / 256 * 256;
    char* other;
    CHECK(cudaMalloc(&other, other_total));
    CHECK(cudaMemset(other, 0, other_total));
    std::vector<Range> hother;
    for (size_t i = 0, at = 0; i < hranges.size(); at += (hranges[i].bytes + 255) / 256 * 256, ++i)
        hother.push_back({other + at, hranges[i].bytes});
    Range* other_ranges;
    CHECK(cudaMalloc(&other_ranges, hother.size() * sizeof(Range)));
    CHECK(cudaMemcpy(other_ranges, hother.data(), hother.size() * sizeof(Range), cudaMemcpyHostToDevice));
    cudaStream_t side;
    CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    cudaEvent_t fork, join;
    CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
    std::vector<std::vector<float>> outs;
    const unsigned long long mask = argc > 2 ? strtoull(argv[2], nullptr, 0) : (1ull << modes) - 1;
    for (int mode = 0; mode < modes; ++mode) {
        if (!(mask >> mode & 1)) {
            outs.push_back({});
            continue;
        }
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        size_t max_block_smem = 0;
        // Modes 1-3 and from 30 run matvec_resident; 4-29 lily's kernels with marks.
        const bool resident = (mode >= 1 && mode < 4) || mode >= ldgsts_from;
        const bool marked = mode >= 4 && !resident, streamed = mode >= 5 && !resident;
        if (streamed) {
            CHECK(cudaEventRecord(fork, stream));
            CHECK(cudaStreamWaitEvent(side, fork, 0));
            const bool copies = (mode >= copy_from && mode < loads_from) || (mode >= throttled_from && mode < warm_from);
            const bool other_bytes = (mode >= other_bytes_from && mode <= copy_from) || mode == 22;
            const unsigned wrap = mode >= wrap_from && mode < copy_from ? 4u << 20 : 0u;
            // Threads of the streamer: 1,024, or for the throttled copiers as many as copies in flight.
            const int threads = mode >= throttled_from ? 4 << 2 * (mode - throttled_from) : 1024;
            const dim3 sgrid(threads >= 32 ? threads / 32 : 1), sblock(threads >= 32 ? 32 : threads);
            if (mode >= warm_from)
                warm_l2<<<WARM_BLOCKS, 1024, max_smem, side>>>(ranges, PRODUCTS, aheads[mode],
                                                                       mode == 28 ? all_shapes : warmed,
                                                                       (int)shapes.size(), step, progress, ready, sink);
            else if (mode >= loads_from && mode < throttled_from)
                stream_loads<<<LOADER_BLOCKS, 1024, 0, side>>>(other_bytes ? other_ranges : ranges, PRODUCTS,
                                                               aheads[mode], step, progress, sink);
            else
                stream_weights<<<sgrid, sblock, copies ? 32768 : 0, side>>>(other_bytes ? other_ranges : ranges,
                                                                    mode == 8 ? 0 : PRODUCTS, aheads[mode],
                                                                    paces[mode], wrap, copies, step, progress);
            CHECK(cudaEventRecord(join, side));
        }
        if (marked) chain_start<<<1, 1, 0, stream>>>(chain_time, ready, mode >= warm_from ? WARM_BLOCKS : 0);
        const int chain_sms = mode >= warm_from ? sms - WARM_BLOCKS : sms;
        for (int i = 0; i < PRODUCTS; ++i) {
            const Weight& l = layers[i];
            const float* x = i == 0 ? x0 : ys[i - 1];
            cudaLaunchConfig_t cfg = {};
            cfg.stream = stream;
            cfg.attrs = &attr;
            cfg.numAttrs = 1;
            const float* no_add = nullptr;
            if (marked) {
                const int r = l.cols <= 2048 ? 2 : 1;
                cfg.gridDim = dim3(std::min((l.rows + 8 * r - 1) / (8 * r), 3 * chain_sms));
                cfg.blockDim = dim3(256);
                cfg.dynamicSmemBytes = (64 + staged_floats(l.cols)) * 4;
                // Marks carry step * 64 + i (the streamer reads the step counter too).
                unsigned* prog = progress;
                const unsigned* st = step;
                if (r == 2)
                    CHECK(cudaLaunchKernelEx(&cfg, matvec_two_rows_marked, l, x, (const float*)norm, eps, ys[i], prog, st,
                                             (unsigned)i));
                else
                    CHECK(cudaLaunchKernelEx(&cfg, matvec_marked, l, x, (const float*)norm, eps, ys[i], prog, st,
                                             (unsigned)i));
            } else if (mode == 0) {
                const int r = l.cols <= 2048 ? 2 : 1;
                cfg.gridDim = dim3(std::min((l.rows + 8 * r - 1) / (8 * r), 3 * sms));
                cfg.blockDim = dim3(256);
                cfg.dynamicSmemBytes = (64 + staged_floats(l.cols)) * 4;
                if (r == 2)
                    CHECK(cudaLaunchKernelEx(&cfg, matvec_two_rows, l, x, (const float*)norm, eps, ys[i], no_add));
                else
                    CHECK(cudaLaunchKernelEx(&cfg, matvec, l, x, (const float*)norm, eps, ys[i], no_add));
            } else {
                const int blocks = mode == 3 ? 2 * sms : sms;
                int most = 0;
                for (int b = 0; b < blocks; ++b)
                    most = std::max(most, resident_rows(l.rows, blocks, b + 1) - resident_rows(l.rows, blocks, b));
                cfg.gridDim = dim3(blocks);
                cfg.blockDim = dim3(RES_THREADS);
                cfg.dynamicSmemBytes = (size_t)most * (l.cols / 2 + l.cols / 64 * 4) + (staged_floats(l.cols) + 64) * 4;
                max_block_smem = std::max(max_block_smem, cfg.dynamicSmemBytes);
                const int early = mode == 2 || mode == 3 || mode == 31, ldgsts = mode >= ldgsts_from;
                int* log = smlog + i * 1024;
                if (l.cols == 2048)
                    CHECK(cudaLaunchKernelEx(&cfg, matvec_resident<2>, l, x, (const float*)norm, eps, ys[i], early, ldgsts, log, stamps + (size_t)i * 1024 * 5));
                else
                    CHECK(cudaLaunchKernelEx(&cfg, matvec_resident<4>, l, x, (const float*)norm, eps, ys[i], early, ldgsts, log, stamps + (size_t)i * 1024 * 5));
            }
        }
        if (marked) {
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(1);
            cfg.blockDim = dim3(1);
            cfg.stream = stream;
            cfg.attrs = &attr;
            cfg.numAttrs = 1;
            CHECK(cudaLaunchKernelEx(&cfg, bump_step, step, chain_time));
        }
        if (streamed) CHECK(cudaStreamWaitEvent(stream, join, 0));
        CHECK(cudaStreamEndCapture(stream, &graph));
        CHECK(cudaGraphInstantiate(&exec, graph, 0));
        for (int r = 0; r < 10; ++r) CHECK(cudaGraphLaunch(exec, stream));
        CHECK(cudaStreamSynchronize(stream));
        CHECK(cudaMemset(chain_time, 0, 2 * sizeof(unsigned long long)));
        const double us = replay_us(exec, stream, reps, e0, e1);
        printf("%-24s %8.1f us per chain, %6.2f us per product, %6.0f GB/s", names[mode], us, us / PRODUCTS,
               total_bytes / (us * 1e3));
        if (marked) {
            unsigned long long t[2];
            CHECK(cudaMemcpy(t, chain_time, sizeof t, cudaMemcpyDeviceToHost));
            printf("  (the chain itself %.2f us per product)", t[1] / 1e3 / reps / PRODUCTS);
        }
        if (resident) {
            // Blocks per SM of each product in the last replay: the most on one SM, SMs unused.
            std::vector<int> h(PRODUCTS * 1024);
            CHECK(cudaMemcpy(h.data(), smlog, h.size() * 4, cudaMemcpyDeviceToHost));
            int worst = 0, unused = 0;
            const int blocks = mode == 3 ? 2 * sms : sms;
            for (int i = 0; i < PRODUCTS; ++i) {
                std::vector<int> count(1024, 0);
                for (int b = 0; b < blocks; ++b) count[h[i * 1024 + b] & 1023]++;
                int used = 0;
                for (int c : count) used += c > 0, worst = std::max(worst, c);
                unused = std::max(unused, sms - used);
            }
            printf("  (block smem up to %zu B; most blocks on one SM %d, SMs unused up to %d)", max_block_smem, worst,
                   unused);
            // Phases per shape (us, means over its products after the first): block start, first
            // wait passed, median staged, median weights arrived, median / last exit, all from
            // the previous product's last exit; and the median copy time (weights arrived - start).
            std::vector<unsigned long long> st(PRODUCTS * 1024 * 5);
            CHECK(cudaMemcpy(st.data(), stamps, st.size() * 8, cudaMemcpyDeviceToHost));
            const int kinds = (int)shapes.size();
            std::vector<std::vector<double>> ph(kinds, std::vector<double>(8, 0.0));
            std::vector<int> n(kinds, 0);
            unsigned long long prev_end = 0;
            for (int i = 0; i < PRODUCTS; ++i) {
                std::vector<unsigned long long> v[5];
                std::vector<long long> copy;
                for (int b = 0; b < blocks; ++b) {
                    for (int k = 0; k < 5; ++k) v[k].push_back(st[((size_t)i * 1024 + b) * 5 + k]);
                    copy.push_back((long long)(st[((size_t)i * 1024 + b) * 5 + 3] - st[((size_t)i * 1024 + b) * 5 + 0]));
                }
                for (int k = 0; k < 5; ++k) std::sort(v[k].begin(), v[k].end());
                std::sort(copy.begin(), copy.end());
                const unsigned long long end = v[4].back();
                if (i > 0) {
                    const double p = (double)prev_end;
                    std::vector<double>& q = ph[i % kinds];
                    q[0] += (v[0][blocks / 2] - p) / 1e3;
                    q[1] += (v[1].front() - p) / 1e3;
                    q[2] += (v[2][blocks / 2] - p) / 1e3;
                    q[3] += (v[3][blocks / 2] - p) / 1e3;
                    q[4] += (v[4][blocks / 2] - p) / 1e3;
                    q[5] += (end - p) / 1e3;
                    q[6] += copy[blocks / 2] / 1e3;
                    q[7] += copy.back() / 1e3;
                    n[i % kinds]++;
                }
                prev_end = end;
            }
            for (int k = 0; k < kinds; ++k) {
                const double m = n[k] ? 1.0 / n[k] : 0.0;
                printf("\n    %dx%d: start %.2f, wait %.2f, staged %.2f, weights %.2f, exit %.2f / %.2f; copy %.2f (max %.2f)",
                       shapes[k].first, shapes[k].second, ph[k][0] * m, ph[k][1] * m, ph[k][2] * m, ph[k][3] * m,
                       ph[k][4] * m, ph[k][5] * m, ph[k][6] * m, ph[k][7] * m);
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

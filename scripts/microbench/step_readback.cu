// Microbenchmark (not part of lily): what reading one step's chosen id back costs between two
// replays of a decode step's graph, by the ways a host can read it. The "step" is a graph of
// LAUNCHES dependent kernels (programmatic dependent launch, 132 blocks of 256 threads, each
// spinning SPIN_NS on %globaltimer after its wait, so a replay lasts about as long as lily's
// ~1.2 ms step); its last kernel writes a token id to device memory, and in `mapped` also to
// page-locked host memory mapped into the device. Per mode, microseconds per step over STEPS
// steps, each step launched only once the previous one's id is on the host (lily's
// step-by-step decode), against the same graph replayed back to back (no host in the loop):
//   pageable   cudaMemcpyAsync into pageable memory (what cudarc's `clone_dtoh` does; the
//              driver returns once the copy is done)
//   pinned     cudaMemcpyAsync into page-locked memory, then cudaStreamSynchronize
//   pinned+ev  the same, waited on an event recorded after the copy (cudaEventSynchronize)
//   mapped     the last kernel stores the id into mapped host memory; the host, which set the
//              word to a sentinel before the launch, spins until it changes
//   ... alt    back to back and mapped again, alternating between two instantiations of the
//              same graph, so that no launch finds its own exec still in flight (back to back,
//              one exec, measured ~54 us a step slower than mapped on an H100: is that the
//              relaunch of an exec in flight, or the queue of steps?)
// The difference to `back to back` is what each way adds to every decoded token.
//   nvcc -O3 -arch=sm_90a -std=c++17 -o step_readback scripts/microbench/step_readback.cu
//   ./step_readback [LAUNCHES [SPIN_NS [STEPS]]]    (defaults 224, 5000, 400)
#include <chrono>

#include "chain_host.h"

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// One link of the chain: lets the next kernel's blocks start, waits for the previous kernel,
// then spins. The last link (ids non-null) picks the step's id from a counter and writes it.
__global__ void link(unsigned spin_ns, int* counter, int* id_device, volatile int* id_host) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const unsigned long long until = now_ns() + spin_ns;
    while (now_ns() < until) {
    }
    if (counter != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
        const int id = ++*counter;
        *id_device = id;
        if (id_host != nullptr) *id_host = id;
    }
}

static cudaGraphExec_t capture(cudaStream_t s, int launches, unsigned spin_ns, int* counter, int* id_device,
                               int* id_host_mapped) {
    cudaLaunchAttribute pdl;
    pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    pdl.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(132);
    cfg.blockDim = dim3(256);
    cfg.stream = s;
    cfg.attrs = &pdl;
    cfg.numAttrs = 1;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < launches; ++i) {
        const bool last = i + 1 == launches;
        CHECK(cudaLaunchKernelEx(&cfg, link, spin_ns, last ? counter : (int*)nullptr, id_device,
                                 last ? (volatile int*)id_host_mapped : (volatile int*)nullptr));
    }
    cudaGraph_t g;
    CHECK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t exec;
    CHECK(cudaGraphInstantiate(&exec, g, 0));
    CHECK(cudaGraphDestroy(g));
    return exec;
}

int main(int argc, char** argv) {
    const int launches = argc > 1 ? atoi(argv[1]) : 224;
    const unsigned spin_ns = argc > 2 ? (unsigned)atoi(argv[2]) : 5000;
    const int steps = argc > 3 ? atoi(argv[3]) : 400;
    CHECK(cudaSetDeviceFlags(cudaDeviceMapHost));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    int *counter, *id_device, *pinned, *mapped, *mapped_dev;
    CHECK(cudaMalloc(&counter, sizeof(int)));
    CHECK(cudaMalloc(&id_device, sizeof(int)));
    CHECK(cudaMemset(counter, 0, sizeof(int)));
    CHECK(cudaHostAlloc(&pinned, sizeof(int), cudaHostAllocDefault));
    CHECK(cudaHostAlloc(&mapped, sizeof(int), cudaHostAllocMapped));
    CHECK(cudaHostGetDevicePointer(&mapped_dev, mapped, 0));
    int* pageable = (int*)malloc(sizeof(int));
    cudaEvent_t done;
    CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    cudaGraphExec_t plain = capture(s, launches, spin_ns, counter, id_device, nullptr);
    cudaGraphExec_t with_host = capture(s, launches, spin_ns, counter, id_device, mapped_dev);
    cudaGraphExec_t plain_twin = capture(s, launches, spin_ns, counter, id_device, nullptr);
    cudaGraphExec_t with_host_twin = capture(s, launches, spin_ns, counter, id_device, mapped_dev);

    using clock = std::chrono::steady_clock;
    auto per_step = [&](auto step) {
        for (int i = 0; i < 20; ++i) step();  // warm-up
        const auto t0 = clock::now();
        for (int i = 0; i < steps; ++i) step();
        CHECK(cudaStreamSynchronize(s));  // back to back, the launches return before their steps end
        return std::chrono::duration<double, std::micro>(clock::now() - t0).count() / steps;
    };
    int last = 0;
    auto check_id = [&](int id) {
        if (id <= last) {
            printf("id went from %d to %d: a stale read\n", last, id);
            exit(1);
        }
        last = id;
    };
    const double back_to_back = per_step([&] { CHECK(cudaGraphLaunch(plain, s)); });
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaMemcpy(&last, id_device, sizeof(int), cudaMemcpyDeviceToHost));
    const double pageable_us = per_step([&] {
        CHECK(cudaGraphLaunch(plain, s));
        CHECK(cudaMemcpyAsync(pageable, id_device, sizeof(int), cudaMemcpyDeviceToHost, s));
        check_id(*pageable);
    });
    const double pinned_us = per_step([&] {
        CHECK(cudaGraphLaunch(plain, s));
        CHECK(cudaMemcpyAsync(pinned, id_device, sizeof(int), cudaMemcpyDeviceToHost, s));
        CHECK(cudaStreamSynchronize(s));
        check_id(*(volatile int*)pinned);
    });
    const double event_us = per_step([&] {
        CHECK(cudaGraphLaunch(plain, s));
        CHECK(cudaMemcpyAsync(pinned, id_device, sizeof(int), cudaMemcpyDeviceToHost, s));
        CHECK(cudaEventRecord(done, s));
        CHECK(cudaEventSynchronize(done));
        check_id(*(volatile int*)pinned);
    });
    const double mapped_us = per_step([&] {
        volatile int* word = mapped;
        *word = -1;
        CHECK(cudaGraphLaunch(with_host, s));
        int id;
        while ((id = *word) == -1) {
        }
        check_id(id);
    });
    int flip = 0;
    const double back_to_back_alt = per_step([&] { CHECK(cudaGraphLaunch((flip ^= 1) ? plain_twin : plain, s)); });
    CHECK(cudaMemcpy(&last, id_device, sizeof(int), cudaMemcpyDeviceToHost));
    const double mapped_alt_us = per_step([&] {
        volatile int* word = mapped;
        *word = -1;
        CHECK(cudaGraphLaunch((flip ^= 1) ? with_host_twin : with_host, s));
        int id;
        while ((id = *word) == -1) {
        }
        check_id(id);
    });
    CHECK(cudaStreamSynchronize(s));
    printf("%d launches of %u ns spin, %d steps; us per step (and over back to back)\n", launches, spin_ns, steps);
    printf("back to back  %9.2f\n", back_to_back);
    const char* names[] = {"pageable", "pinned", "pinned+ev", "mapped", "b2b alt", "mapped alt"};
    const double us[] = {pageable_us, pinned_us, event_us, mapped_us, back_to_back_alt, mapped_alt_us};
    for (int i = 0; i < 6; ++i) printf("%-12s  %9.2f  (+%.2f)\n", names[i], us[i], us[i] - back_to_back);
    return 0;
}

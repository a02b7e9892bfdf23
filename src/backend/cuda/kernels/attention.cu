// Gated full attention. Decode: q/k RMSNorm and partial RoPE with the KV-cache append, then
// attention split over the context on tensor cores (flash-decoding: each block covers a slice of
// positions for up to 8 query heads of one KV head, with an online softmax), then a combine that
// applies the output gate. Prefill: causal flash attention on tensor cores over a chunk's tokens.


struct AttentionDims {
    int heads, kv_heads, head_dim, rotary_dim, max_context, splits;
    float eps;
    float rope_theta;
};

// The per-sequence buffers of a batched decode step (see seq_buffer): all null for one sequence.
// batch_context: where the step's sequences share its context splits, the sum of their context
// lengths (written by `embed`); null where each token takes d.splits of its own context.
struct AttentionSeqs {
    const unsigned long long* position;
    const unsigned long long* k_cache;
    const unsigned long long* v_cache;
    const int* batch_context;
};

// Floats of one token's projection: [heads * 2 * head_dim (per head: query, gate) |
// kv_heads * head_dim (k) | kv_heads * head_dim (v)].
__device__ __forceinline__ int attention_proj_width(const AttentionDims& d) {
    return (2 * d.heads + 2 * d.kv_heads) * d.head_dim;
}

// Writes q (normed, rotated) and appends k, v at their positions to the bf16 caches [ctx, kv, hd]
// for tokens at positions position[0] + t, t = blockIdx.y (proj and q_out rows one per token);
// batched, row blockIdx.y is the token of sequence blockIdx.y of the tables.
// Launch: (heads + kv_heads, tokens) blocks of head_dim threads.
// The next kernel (attention_split, or attention_prefill) may start before this one waits for
// the qkv projection: before its own wait it reads only the positions and the cache rows of
// earlier steps. So attention_split's blocks become resident, and request the cached keys and
// values, as the projection's blocks leave, where they would otherwise wait for all of them.
extern "C" __global__ void __launch_bounds__(256) attention_prepare(AttentionDims d, const float* proj, const float* q_norm,
                                             const float* k_norm, const int* position, float* q_out,
                                             bf16* k_cache, bf16* v_cache, AttentionSeqs seqs) {
    TRACE_BLOCK();
    let_next_kernel_start();
    __shared__ float scratch[32];
    extern __shared__ float head[];
    const int b = blockIdx.x, i = threadIdx.x, hd = d.head_dim;
    const bool is_q = b < d.heads;
    const float norm_w = is_q ? q_norm[i] : k_norm[i];  // a weight: before the wait
    wait_for_previous_kernel();
    // Token blockIdx.y of a run of tokens at consecutive positions, or of a batch.
    const int t = blockIdx.y;
    const int pos = row_position(position, seqs.position, t);
    k_cache = seq_buffer(k_cache, seqs.k_cache, t);
    v_cache = seq_buffer(v_cache, seqs.v_cache, t);
    proj += (size_t)t * attention_proj_width(d);
    q_out += (size_t)t * d.heads * hd;
    const int kvh = b - d.heads;
    const float* src = is_q ? proj + (size_t)b * 2 * hd : proj + (size_t)d.heads * 2 * hd + (size_t)kvh * hd;
    const float x = src[i];
    // A KV head's value row is read with its key row, in the same L2 round trip (after the
    // norm's barriers the load would be one more).
    const float* vsrc = proj + (size_t)d.heads * 2 * hd + (size_t)(d.kv_heads + kvh) * hd;
    const float v = is_q ? 0.0f : vsrc[i];
    const float ss = block_sum(x * x, scratch);
    head[i] = x * rsqrtf(ss / hd + d.eps) * norm_w;
    __syncthreads();
    float y = head[i];
    const int half = d.rotary_dim / 2;
    if (i < d.rotary_dim) {
        const int f = i < half ? i : i - half;
        // Same as the reference: inverse frequency and angle formed in f32.
        const float inv_freq = 1.0f / powf(d.rope_theta, (float)(2 * f) / (float)d.rotary_dim);
        const float angle = (float)pos * inv_freq;
        float sn, cs;
        sincosf(angle, &sn, &cs);
        y = i < half ? head[i] * cs - head[i + half] * sn : head[i] * cs + head[i - half] * sn;
    }
    if (is_q) {
        q_out[(size_t)b * hd + i] = y;
    } else {
        const size_t at = ((size_t)pos * d.kv_heads + kvh) * hd + i;
        k_cache[at] = __float2bfloat16(y);
        v_cache[at] = __float2bfloat16(v);
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core pieces shared by decode and prefill.

// D += A B for one m16n8k16 tile, bf16 inputs, f32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 bf16 matrices from shared memory: lanes 8i .. 8i + 7 give the addresses of matrix i's
// rows; register i receives matrix i with lane l holding (row l / 4, cols 2 (l % 4), +1), or with
// `.trans` (rows 2 (l % 4), +1; col l / 4).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// Two floats as a bf16 pair, `lo` in the low half (the lower column of an mma fragment).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// Transposes an 8x8 bf16 matrix held one row pair per lane (lane l: row l / 4, cols 2 (l % 4),
// +1) into the same layout of its transpose.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t v) {
    uint32_t r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(v));
    return r;
}

// ---------------------------------------------------------------------------------------------
// Decode: attention split over the context, on tensor cores.
//
// A block takes one split of the context for up to DECODE_HEADS query heads of one KV head; each
// of its DECODE_WARPS warps walks its own DECODE_TILE-position tiles of the split (tile i of warp
// w starts at begin + DECODE_TILE (w + DECODE_WARPS i)) with its own online softmax, and the
// warps merge at the end. Per tile, with the query heads as the mma's n = 8 columns (so grouped
// queries waste nothing) and positions or head dimensions as its m = 16 rows:
//   S^T = K Q^T     (rows: positions; k: head dims; K from shared memory by ldmatrix, Q^T
//                    fragments in registers for the whole split),
//   O^T += V^T P^T  (rows: head dims; k: positions; V^T by ldmatrix.trans, P^T from S^T's
//                    accumulators by movmatrix.trans).
// A thread's S^T and O^T accumulators hold the same two heads (2c, 2c + 1, c = lane % 4), so the
// softmax rescaling stays in registers. Q and P are rounded to bf16, as in prefill.

#define DECODE_TILE 16   // positions per warp tile (the mma's m)
#define DECODE_WARPS 8
#define DECODE_HEADS 8   // query heads per block (the mma's n)
#define DECODE_ROW_PAD 8  // bf16 after each shared row: the 8 rows one ldmatrix reads fall in distinct banks

// Positions per split for a context of `len` tokens: whole rounds of the block's warp tiles, at
// most `max_splits` splits.
__device__ __forceinline__ int attention_split_len(int len, int max_splits) {
    constexpr int ROUND = DECODE_TILE * DECODE_WARPS;
    const int per = div_fast(len + max_splits - 1, max_splits);
    return (per + ROUND - 1) / ROUND * ROUND;
}

// Positions per split of a token's context of `len` positions: d.splits splits of it, or, where
// the batch's sequences share the splits (batch_context not null), about its share of them in
// proportion to its length (at least one; the splits of all the batch's tokens then fill about
// one wave of blocks however their lengths differ). Either way at most max_splits splits.
__device__ __forceinline__ int attention_token_split_len(int len, int max_splits, const int* batch_context) {
    if (batch_context == nullptr) return attention_split_len(len, max_splits);
    const int target = (*batch_context + max_splits - 1) / max_splits;
    return attention_split_len(len, max(1, (len + target / 2) / target));
}

// Copies cache rows first .. first + DECODE_TILE - 1 of one KV head (`cache` points to the head's
// first row, rows `row_stride` apart, hd values each) into a warp's shared tile (rows of
// D + DECODE_ROW_PAD bf16): rows at positions in [lo, hi), and, with `zero_rest`, zeros for rows
// at or past `end` and columns past hd (never read from the cache: such rows may lie past its end).
template <int D>
__device__ __forceinline__ void decode_stage_rows(uint32_t tile, const bf16* cache, size_t row_stride, int hd,
                                                  int first, int lo, int hi, int end, bool zero_rest, int lane) {
    constexpr int CHUNKS = D / 8;  // 16-byte pieces per row
#pragma unroll 4
    for (int i = lane; i < DECODE_TILE * CHUNKS; i += 32) {
        const int row = i / CHUNKS, chunk = i % CHUNKS, pos = first + row;
        const bool empty = pos >= end || chunk * 8 >= hd;
        if (empty ? zero_rest : pos >= lo && pos < hi)
            cp_async_16(tile + (uint32_t)(row * (D + DECODE_ROW_PAD) + chunk * 8) * 2,
                        empty ? cache : cache + (size_t)pos * row_stride + chunk * 8, !empty);
    }
}

// Split `split` of token `token` by block (KV head * head tiles + head tile, ...), DECODE_WARPS
// warps: token `token` of a run at consecutive positions attends to positions
// [0, position[0] + token] (batched: the token of sequence `token` of the tables, to its positions
// [0, position]); the block takes the split's positions for query heads tile * DECODE_HEADS ..
// + DECODE_HEADS - 1 of the KV head's group. Writes per (head, split): the running max, sum and
// unnormalised output. Splits past the context return at once. D: head_dim rounded up to an
// instantiated width; SHARED: the batch's tokens share the splits (attention_token_split_len).
// The block's first split (`first_of_block`) requests the rows cached before this step before
// waiting for the previous kernel; a later one's come after.
// Dynamic shared memory: per warp a key and a value tile of DECODE_TILE rows of D + DECODE_ROW_PAD
// bf16 (reused for the warps' merge: DECODE_WARPS * DECODE_HEADS * D floats).
template <int D, bool SHARED>
__device__ __forceinline__ void attention_split_impl(const AttentionDims& d, const float* q, const bf16* k_cache,
                                                     const bf16* v_cache, const int* position, float* part_max,
                                                     float* part_sum, float* part_out, const AttentionSeqs& seqs,
                                                     int token, int split, bool first_of_block) {
    static_assert(D % 16 == 0, "16-wide slices of a head");
    constexpr int STRIDE = D + DECODE_ROW_PAD;                 // bf16 per shared row
    constexpr uint32_t TILE_BYTES = DECODE_TILE * STRIDE * 2;  // one key or value tile
    constexpr int SLICES = D / 16;
    static_assert(DECODE_WARPS * DECODE_HEADS * D * 4 <= DECODE_WARPS * 2 * TILE_BYTES, "the merge fits the tiles");
    extern __shared__ __align__(16) bf16 kv_tiles[];
    __shared__ float merge_max[DECODE_WARPS][DECODE_HEADS], merge_sum[DECODE_WARPS][DECODE_HEADS];
    const int group = div_fast(d.heads, d.kv_heads), head_tiles = (group + DECODE_HEADS - 1) / DECODE_HEADS;
    const int kvh = div_fast(blockIdx.x, head_tiles), tile_head = mod_fast(blockIdx.x, head_tiles) * DECODE_HEADS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int hd = d.head_dim;
    // The position was set by an earlier step, the cache below it by earlier launches: this
    // warp's first tile there is requested before waiting for attention_prepare (which appends
    // this launch's tokens and writes q).
    const int len = row_position(position, seqs.position, token) + 1;
    const int cached = seqs.position != nullptr ? len - 1 : position[0];
    k_cache = seq_buffer(k_cache, seqs.k_cache, token);
    v_cache = seq_buffer(v_cache, seqs.v_cache, token);
    q += (size_t)token * d.heads * hd;
    part_max += (size_t)token * d.heads * d.splits;
    part_sum += (size_t)token * d.heads * d.splits;
    part_out += (size_t)token * d.heads * d.splits * hd;
    const int per = SHARED ? attention_token_split_len(len, d.splits, seqs.batch_context)
                           : attention_split_len(len, d.splits);
    const int begin = split * per;
    if (begin >= len) return;
    const int end = min(len, begin + per);
    const size_t row_stride = (size_t)d.kv_heads * hd;
    const bf16* k_head = k_cache + (size_t)kvh * hd;
    const bf16* v_head = v_cache + (size_t)kvh * hd;
    const uint32_t k_tile = shared_address(kv_tiles) + warp * 2 * TILE_BYTES, v_tile = k_tile + TILE_BYTES;
    int first = begin + DECODE_TILE * warp;
    const int staged = first_of_block ? cached : len;
    if (first < end) {
        decode_stage_rows<D>(k_tile, k_head, row_stride, hd, first, 0, staged, end, true, lane);
        decode_stage_rows<D>(v_tile, v_head, row_stride, hd, first, 0, staged, end, true, lane);
    }
    if (first_of_block) {
        wait_for_previous_kernel();
        if (first < end) {
            decode_stage_rows<D>(k_tile, k_head, row_stride, hd, first, cached, len, end, false, lane);
            decode_stage_rows<D>(v_tile, v_head, row_stride, hd, first, cached, len, end, false, lane);
        }
    }
    cp_async_commit();

    // Q^T fragments (k: head dims, n: heads): lane (g, c) holds head g's dims 2c, 2c + 1 and
    // 2c + 8, 2c + 9 of each slice, scaled by 1/sqrt(head_dim); zeros past the group and hd.
    const int head_in_group = tile_head + g;
    const float* qh = q + ((size_t)kvh * group + head_in_group) * hd;
    const float scale = rsqrtf((float)hd);
    uint32_t qf[SLICES][2];
#pragma unroll
    for (int t = 0; t < SLICES; ++t) {
        float2 lo = make_float2(0.0f, 0.0f), hi = lo;
        if (head_in_group < group && 16 * t < hd) {
            lo = *reinterpret_cast<const float2*>(qh + 16 * t + 2 * c);
            hi = *reinterpret_cast<const float2*>(qh + 16 * t + 2 * c + 8);
        }
        qf[t][0] = pack_bf16(lo.x * scale, lo.y * scale);
        qf[t][1] = pack_bf16(hi.x * scale, hi.y * scale);
    }

    // O^T accumulators: slice t, rows (dims) 16 t + g and + 8, columns (heads) 2c and 2c + 1.
    float o[SLICES][4];
#pragma unroll
    for (int t = 0; t < SLICES; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.0f;
    // Heads 2c, 2c + 1: running max (the same in every lane of the column) and the sum over
    // this lane's positions (summed over the column at the end).
    float run_max[2] = {-INFINITY, -INFINITY}, run_sum[2] = {0.0f, 0.0f};
    // ldmatrix row addresses: K's matrices are (positions 0-7 | 8-15) x (dims 0-7 | 8-15) of the
    // slice in A order; V's, transposed, (dims 0-7 | 8-15) x (positions 0-7 | 8-15).
    const int k_row = (lane & 7) + ((lane >> 3) & 1) * 8, k_col = (lane >> 4) * 8;
    const int v_row = (lane & 7) + (lane >> 4) * 8, v_col = ((lane >> 3) & 1) * 8;
    for (; first < end; first += DECODE_TILE * DECODE_WARPS) {
        cp_async_wait<0>();
        __syncwarp();
        // S^T: two accumulators halve the dependent chain of products.
        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int t = 0; t < SLICES; ++t) {
            uint32_t a[4];
            ldmatrix_x4(a, k_tile + (uint32_t)(k_row * STRIDE + 16 * t + k_col) * 2);
            mma_bf16_16816(s[t & 1], a, qf[t][0], qf[t][1]);
        }
        // Lane (g, c): positions g and g + 8 for heads 2c, 2c + 1; positions past the end masked.
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = first + g + (i >> 1) * 8 < end ? s[0][i] + s[1][i] : -INFINITY;
        float m[2] = {fmaxf(v[0], v[2]), fmaxf(v[1], v[3])};
#pragma unroll
        for (int mask = 4; mask < 32; mask <<= 1) {
            m[0] = fmaxf(m[0], __shfl_xor_sync(0xffffffffu, m[0], mask));
            m[1] = fmaxf(m[1], __shfl_xor_sync(0xffffffffu, m[1], mask));
        }
        // The tile's first position is in range, so the new maxima are finite.
        float correction[2], e[4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float new_max = fmaxf(run_max[h], m[h]);
            correction[h] = __expf(run_max[h] - new_max);
            run_max[h] = new_max;
            e[h] = __expf(v[h] - new_max);
            e[h + 2] = __expf(v[h + 2] - new_max);
            run_sum[h] = run_sum[h] * correction[h] + e[h] + e[h + 2];
        }
#pragma unroll
        for (int t = 0; t < SLICES; ++t) {
            o[t][0] *= correction[0];
            o[t][1] *= correction[1];
            o[t][2] *= correction[0];
            o[t][3] *= correction[1];
        }
        // P^T as the B operand (k: positions, n: heads): the transposes of P's two 8x8 blocks.
        const uint32_t p0 = movmatrix_trans(pack_bf16(e[0], e[1]));
        const uint32_t p1 = movmatrix_trans(pack_bf16(e[2], e[3]));
#pragma unroll
        for (int t = 0; t < SLICES; ++t) {
            uint32_t a[4];
            ldmatrix_x4_trans(a, v_tile + (uint32_t)(v_row * STRIDE + 16 * t + v_col) * 2);
            mma_bf16_16816(o[t], a, p0, p1);
        }
        __syncwarp();
        const int next = first + DECODE_TILE * DECODE_WARPS;
        if (next < end) {
            decode_stage_rows<D>(k_tile, k_head, row_stride, hd, next, 0, end, end, true, lane);
            decode_stage_rows<D>(v_tile, v_head, row_stride, hd, next, 0, end, end, true, lane);
        }
        cp_async_commit();
    }

    // Merge the warps: each scales its sums and outputs to the block's maxima (a warp without
    // positions has max -inf, sum 0 and contributes nothing).
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int mask = 4; mask < 32; mask <<= 1) run_sum[h] += __shfl_xor_sync(0xffffffffu, run_sum[h], mask);
    if (g == 0) {
        merge_max[warp][2 * c] = run_max[0];
        merge_max[warp][2 * c + 1] = run_max[1];
        merge_sum[warp][2 * c] = run_sum[0];
        merge_sum[warp][2 * c + 1] = run_sum[1];
    }
    cp_async_wait<0>();
    __syncthreads();
    float* merged = reinterpret_cast<float*>(kv_tiles);  // [warp][head][D]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float block_max = -INFINITY;
#pragma unroll
        for (int w = 0; w < DECODE_WARPS; ++w) block_max = fmaxf(block_max, merge_max[w][2 * c + h]);
        const float f = run_max[h] == -INFINITY ? 0.0f : __expf(run_max[h] - block_max);
        float* row = merged + (size_t)(warp * DECODE_HEADS + 2 * c + h) * D;
#pragma unroll
        for (int t = 0; t < SLICES; ++t) {
            row[16 * t + g] = o[t][h] * f;
            row[16 * t + g + 8] = o[t][h + 2] * f;
        }
    }
    __syncthreads();
    const int heads = min(DECODE_HEADS, group - tile_head);
    const int head0 = kvh * group + tile_head;
    for (int i = threadIdx.x; i < heads * hd; i += blockDim.x) {
        const int h = i / hd, dim = i % hd;
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < DECODE_WARPS; ++w) sum += merged[(size_t)(w * DECODE_HEADS + h) * D + dim];
        part_out[((size_t)(head0 + h) * d.splits + split) * hd + dim] = sum;
    }
    if (threadIdx.x < heads) {
        const int h = threadIdx.x;
        float block_max = -INFINITY, sum = 0.0f;
        for (int w = 0; w < DECODE_WARPS; ++w) block_max = fmaxf(block_max, merge_max[w][h]);
        for (int w = 0; w < DECODE_WARPS; ++w)
            if (merge_max[w][h] != -INFINITY) sum += merge_sum[w][h] * __expf(merge_max[w][h] - block_max);
        const size_t slot = (size_t)(head0 + h) * d.splits + split;
        part_max[slot] = block_max;
        part_sum[slot] = sum;
    }
}

// Item `item` of a batch whose tokens share the splits (batch_context not null): the items are
// the tokens' splits in order (token 0's, then token 1's, ...). Returns (token, split), or token
// -1 past the last item. Every warp computes it for itself (each lane a token at a time).
__device__ __forceinline__ int2 attention_shared_item(const AttentionDims& d, const AttentionSeqs& seqs, int rows,
                                                      int item) {
    const int lane = threadIdx.x & 31;
    int before = 0;  // the items of the tokens before this round's
    for (int base = 0; base < rows; base += 32) {
        const int r = base + lane;
        int n = 0;
        if (r < rows) {
            const int len = row_position(nullptr, seqs.position, r) + 1;
            const int per = attention_token_split_len(len, d.splits, seqs.batch_context);
            n = (len + per - 1) / per;
        }
        int upto = n;  // inclusive prefix over the round's lanes
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, upto, o);
            if (lane >= o) upto += v;
        }
        const int start = before + upto - n;
        const unsigned hit = __ballot_sync(0xffffffffu, item >= start && item < start + n);
        if (hit != 0) {
            const int src = __ffs(hit) - 1;
            return make_int2(base + src, item - __shfl_sync(0xffffffffu, start, src));
        }
        before += __shfl_sync(0xffffffffu, upto, 31);
    }
    return make_int2(-1, 0);
}

// Each token with splits of its own: block (head tile, split, token).
template <int D>
__device__ void attention_split_own(const AttentionDims& d, const float* q, const bf16* k_cache, const bf16* v_cache,
                                    const int* position, float* part_max, float* part_sum, float* part_out,
                                    const AttentionSeqs& seqs) {
    attention_split_impl<D, false>(d, q, k_cache, v_cache, position, part_max, part_sum, part_out, seqs, blockIdx.z,
                                   blockIdx.y, true);
}

// The `rows` tokens of a batch sharing the splits (AttentionSeqs::batch_context): block
// (head tile, y) with y < d.splits takes items y, y + d.splits, ... of attention_shared_item, so
// that however the tokens' lengths differ the blocks take about as many positions each, in one
// wave.
template <int D>
__device__ void attention_split_items(const AttentionDims& d, const float* q, const bf16* k_cache,
                                      const bf16* v_cache, float* part_max, float* part_sum, float* part_out,
                                      const AttentionSeqs& seqs, int rows) {
    for (int item = blockIdx.y; ; item += gridDim.y) {
        const int2 at = attention_shared_item(d, seqs, rows, item);
        if (at.x < 0) return;
        // The previous item's merge read the tiles this one stages into.
        if (item != blockIdx.y) __syncthreads();
        attention_split_impl<D, true>(d, q, k_cache, v_cache, nullptr, part_max, part_sum, part_out, seqs, at.x,
                                      at.y, item == blockIdx.y);
    }
}

extern "C" __global__ void __launch_bounds__(DECODE_WARPS * 32) attention_split(AttentionDims d, const float* q,
                                                                             const bf16* k_cache,
                                                                             const bf16* v_cache,
                                                                             const int* position, float* part_max,
                                                                             float* part_sum, float* part_out,
                                                                             AttentionSeqs seqs) {
    TRACE_BLOCK();
    // head_dim: a multiple of 16 (whole slices), at most 256; the backend takes multiples of 32.
    if (d.head_dim <= 32)
        attention_split_own<32>(d, q, k_cache, v_cache, position, part_max, part_sum, part_out, seqs);
    else if (d.head_dim <= 64)
        attention_split_own<64>(d, q, k_cache, v_cache, position, part_max, part_sum, part_out, seqs);
    else if (d.head_dim <= 128)
        attention_split_own<128>(d, q, k_cache, v_cache, position, part_max, part_sum, part_out, seqs);
    else attention_split_own<256>(d, q, k_cache, v_cache, position, part_max, part_sum, part_out, seqs);
}

// attention_split for a batch whose `rows` tokens share the splits: one grid row of d.splits
// blocks per head tile.
extern "C" __global__ void __launch_bounds__(DECODE_WARPS * 32) attention_split_shared(AttentionDims d,
                                                                                    const float* q,
                                                                                    const bf16* k_cache,
                                                                                    const bf16* v_cache,
                                                                                    float* part_max,
                                                                                    float* part_sum,
                                                                                    float* part_out,
                                                                                    AttentionSeqs seqs, int rows) {
    TRACE_BLOCK();
    if (d.head_dim <= 32)
        attention_split_items<32>(d, q, k_cache, v_cache, part_max, part_sum, part_out, seqs, rows);
    else if (d.head_dim <= 64)
        attention_split_items<64>(d, q, k_cache, v_cache, part_max, part_sum, part_out, seqs, rows);
    else if (d.head_dim <= 128)
        attention_split_items<128>(d, q, k_cache, v_cache, part_max, part_sum, part_out, seqs, rows);
    else attention_split_items<256>(d, q, k_cache, v_cache, part_max, part_sum, part_out, seqs, rows);
}

#define COMBINE_DIMS 64     // head dims per combine block
#define COMBINE_PARTS 8     // thread groups splitting the splits
#define COMBINE_HELD 16     // partial outputs a thread requests at once (the splits up to COMBINE_PARTS * 16)
#define COMBINE_MAX_SPLITS 1024

// Merges the splits of each head and applies the output gate sigmoid(gate), for token
// t = blockIdx.z at position position[0] + t (batched: at its sequence's position; the splits as
// attention_split took them, see AttentionSeqs::batch_context). Launch:
// (heads, ceil(head_dim / COMBINE_DIMS), tokens) blocks of COMBINE_DIMS * COMBINE_PARTS threads:
// thread (part, dim) sums the splits s = part (mod COMBINE_PARTS) of its dim, then the parts add
// up in shared memory.
extern "C" __global__ void __launch_bounds__(COMBINE_DIMS * COMBINE_PARTS) attention_combine(
    AttentionDims d, const float* proj, const int* position, const float* part_max, const float* part_sum,
    const float* part_out, float* out, const unsigned long long* position_of, const int* batch_context) {
    TRACE_BLOCK();
    // The next launch (the mixer's output projection) reads before its wait only weights and
    // the residual stream, which the previous layer's MoE wrote before attention_prepare ran, so
    // its blocks may be placed, and request their rows, while attention_split runs. Started after
    // this launch's wait instead, they were placed ~1.4 us before it ended, and their own wait
    // was released ~1.3 us later than other launches' (block traces), behind those requests.
    let_next_kernel_start();
    __shared__ float scratch[32];
    __shared__ float split_weight[COMBINE_MAX_SPLITS];
    __shared__ float partial[COMBINE_PARTS][COMBINE_DIMS];
    const int head = blockIdx.x, hd = d.head_dim, t = blockIdx.z;
    const int dim_in = threadIdx.x % COMBINE_DIMS, part = threadIdx.x / COMBINE_DIMS;
    const int dim = blockIdx.y * COMBINE_DIMS + dim_in;
    // Before the wait: the position (an earlier launch's) and the output gate, which the qkv
    // projection wrote three launches back (attention_split waited for attention_prepare, which
    // waited for it).
    const int len = row_position(position, position_of, t) + 1;
    const int per = attention_token_split_len(len, d.splits, batch_context);
    const int splits = div_fast(len + per - 1, per);
    proj += (size_t)t * attention_proj_width(d);
    const float gate = part == 0 && dim < hd ? proj[(size_t)head * 2 * hd + hd + dim] : 0.0f;
    out += (size_t)t * d.heads * hd;
    part_max += (size_t)t * d.heads * d.splits;
    part_sum += (size_t)t * d.heads * d.splits;
    part_out += (size_t)t * d.heads * d.splits * hd;
    const float* pm = part_max + (size_t)head * d.splits;
    const float* ps = part_sum + (size_t)head * d.splits;
    const float* po = part_out + (size_t)head * d.splits * hd + dim;
    wait_for_previous_kernel();
    // Every read of the splits' results goes out at once, one L2 round trip, the partial outputs
    // into registers before the softmax's two reductions (only splits past what COMBINE_HELD
    // holds, or past one per thread, are read after them).
    const bool own = (int)threadIdx.x < splits;
    const float own_max = own ? pm[threadIdx.x] : -INFINITY, own_sum = own ? ps[threadIdx.x] : 0.0f;
    float held[COMBINE_HELD];
#pragma unroll
    for (int j = 0; j < COMBINE_HELD; ++j) {
        const int s = part + j * COMBINE_PARTS;
        held[j] = dim < hd && s < splits ? po[(size_t)s * hd] : 0.0f;
    }
    float m = own_max;
    for (int s = threadIdx.x + blockDim.x; s < splits; s += blockDim.x) m = fmaxf(m, pm[s]);
    m = block_max(m, scratch);
    float l = 0.0f;
    if (own) {
        const float w = __expf(own_max - m);
        split_weight[threadIdx.x] = w;
        l = w * own_sum;
    }
    for (int s = threadIdx.x + blockDim.x; s < splits; s += blockDim.x) {
        const float w = __expf(pm[s] - m);
        split_weight[s] = w;
        l += w * ps[s];
    }
    l = block_sum(l, scratch);
    float acc = 0.0f;
    if (dim < hd) {
#pragma unroll
        for (int j = 0; j < COMBINE_HELD; ++j) {
            const int s = part + j * COMBINE_PARTS;
            if (s < splits) acc += split_weight[s] * held[j];
        }
        for (int s = part + COMBINE_HELD * COMBINE_PARTS; s < splits; s += COMBINE_PARTS)
            acc += split_weight[s] * po[(size_t)s * hd];
    }
    partial[part][dim_in] = acc;
    __syncthreads();
    if (part == 0 && dim < hd) {
        for (int p = 1; p < COMBINE_PARTS; ++p) acc += partial[p][dim_in];
        out[(size_t)head * hd + dim] = acc / l * sigmoid(gate);
    }
}

// ---------------------------------------------------------------------------------------------
// Prefill: causal flash attention on tensor cores.
//
// A block owns PREFILL_QUERY_TILE consecutive query tokens of one query head (4 warps, 16 rows
// each) and walks the key positions 0 .. position of its last token, PREFILL_KEY_TILE at a time,
// with an online softmax in f32. Scores S = Q K^T and the output O += P V are mma.sync m16n8k16
// products (bf16 in, f32 accumulate); Q is rounded from f32 to bf16 once, K and V come from the
// bf16 cache. Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), g = lane / 4,
// c = lane % 4:
//   A (16x16, row-major): reg 0 = (row g, cols 2c, 2c+1), reg 1 = (row g+8, same cols),
//                         reg 2 = (row g, cols 2c+8, 2c+9), reg 3 = (row g+8, cols 2c+8, 2c+9);
//   B (16x8, col-major):  reg 0 = (k 2c, 2c+1; n g), reg 1 = (k 2c+8, 2c+9; n g);
//   C (16x8, f32):        c0, c1 = (row g, cols 2c, 2c+1), c2, c3 = (row g+8, same cols).
// So a thread holds rows g and g+8 of its warp's 16 query rows throughout, and the S fragments
// of two neighbouring 8-key tiles are, packed to bf16, the A fragment of P for those 16 keys.
// Shared memory holds one tile each of Q, K and V ([64][head_dim + PREFILL_ROW_PAD] bf16): the
// next key tile is copied (cp.async) while P V runs, the value tile while Q K^T runs.

#define PREFILL_QUERY_TILE 64  // query tokens per block: 4 warps of 16 rows
#define PREFILL_KEY_TILE 64    // key positions per step
#define PREFILL_THREADS 128
#define PREFILL_ROW_PAD 8  // bf16 after each shared row: the 8 rows one ldmatrix reads fall in distinct banks

// Starts copying cache rows [first, first + PREFILL_KEY_TILE) of one KV head (`cache` points to
// the head's first row, rows `row_stride` apart, `hd` values used of each) into the shared tile
// at `tile` (rows of D values, hd <= D); rows at or past `end` and columns past hd become zeros
// (never read from the cache: such rows may lie past its end).
template <int D>
__device__ __forceinline__ void prefill_stage_keys(uint32_t tile, const bf16* cache, size_t row_stride, int hd,
                                                   int first, int end) {
    constexpr int CHUNKS = D / 8;  // 16-byte pieces per row
    static_assert(PREFILL_KEY_TILE * CHUNKS % PREFILL_THREADS == 0, "whole rounds of copies");
    // Partly unrolled: fully unrolled, the compiler keeps every copy's addresses live across the
    // main loop and runs out of registers at D = 256.
#pragma unroll 4
    for (int j = 0; j < PREFILL_KEY_TILE * CHUNKS / PREFILL_THREADS; ++j) {
        const int i = threadIdx.x + j * PREFILL_THREADS, row = i / CHUNKS, chunk = i % CHUNKS;
        const bool valid = first + row < end && chunk * 8 < hd;
        const bf16* src = valid ? cache + (size_t)(first + row) * row_stride + chunk * 8 : cache;
        cp_async_16(tile + (uint32_t)(row * (D + PREFILL_ROW_PAD) + chunk * 8) * 2, src, valid);
    }
}

// Block (query head, query tile), PREFILL_THREADS threads. Query tiles run in reverse order of
// blockIdx.y, so the tiles with the most keys start first. out[t, head] = softmax over keys
// 0 ..= position[0] + t of (q[t, head] . k / sqrt(head_dim)) . v, times sigmoid of the gate half
// of proj's row t, for the tile's tokens t < tokens (as attention_combine writes it).
// D: head_dim rounded up to an instantiated width; the columns past head_dim are zeros in the
// shared tiles and not written out. Dynamic shared memory: 3 * 64 * (D + PREFILL_ROW_PAD) bf16
// (the Q, K and V tiles).
template <int D>
__device__ void attention_prefill_impl(const AttentionDims& d, const float* q, const bf16* k_cache,
                                       const bf16* v_cache, const int* position, const float* proj, int tokens,
                                       float* out) {
    static_assert(D % 16 == 0 && PREFILL_QUERY_TILE == 16 * (PREFILL_THREADS / 32) && PREFILL_KEY_TILE % 16 == 0,
                  "16-wide slices; a warp per 16 query rows");
    constexpr int STRIDE = D + PREFILL_ROW_PAD;                  // bf16 per shared row
    constexpr uint32_t TILE_BYTES = PREFILL_KEY_TILE * STRIDE * 2;  // the Q tile has as many rows
    constexpr int KEY_NTILES = PREFILL_KEY_TILE / 8;              // 8-key S tiles per step
    extern __shared__ __align__(16) bf16 prefill_tiles[];
    wait_for_previous_kernel();
    const int hd = d.head_dim;
    const int head = blockIdx.x, kvh = head / (d.heads / d.kv_heads);
    const int tile0 = (gridDim.y - 1 - blockIdx.y) * PREFILL_QUERY_TILE;
    const int rows = min(PREFILL_QUERY_TILE, tokens - tile0);  // the tile's tokens, at least 1
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    // Token t of the chunk sits at position p0 + t and sees keys 0 ..= p0 + t.
    const int p0 = position[0];
    const int key_end = p0 + tile0 + rows;
    const uint32_t q_tile = shared_address(prefill_tiles), k_tile = q_tile + TILE_BYTES, v_tile = k_tile + TILE_BYTES;
    const size_t kv_stride = (size_t)d.kv_heads * hd;
    k_cache += (size_t)kvh * hd;
    v_cache += (size_t)kvh * hd;

    prefill_stage_keys<D>(k_tile, k_cache, kv_stride, hd, 0, key_end);
    cp_async_commit();
    // Q tile to bf16 (rows past the chunk and columns past hd zero); made visible by the first
    // loop's barrier.
    {
        constexpr int QUADS = D / 4;  // float4s per row
#pragma unroll 4
        for (int i = threadIdx.x; i < PREFILL_QUERY_TILE * QUADS; i += PREFILL_THREADS) {
            const int row = i / QUADS, quad = i % QUADS;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (row < rows && quad * 4 < hd)
                v = *reinterpret_cast<const float4*>(q + ((size_t)(tile0 + row) * d.heads + head) * hd + quad * 4);
            *reinterpret_cast<uint2*>(prefill_tiles + row * STRIDE + quad * 4) =
                make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
        }
    }

    // This thread's rows: warp * 16 + g (index 0) and + 8 (index 1). Rows past the chunk take the
    // last token's limit, so that their (unwritten) results stay finite.
    const int row_lo = warp * 16 + g;
    const int limit[2] = {p0 + tile0 + min(row_lo, rows - 1), p0 + tile0 + min(row_lo + 8, rows - 1)};
    // Key tiles starting past the warp's last limit are masked out for all its rows: skipped.
    const bool warp_has_rows = warp * 16 < rows;
    const int warp_limit = p0 + tile0 + min(warp * 16 + 15, rows - 1);
    // Exponentials in base 2: exp(x / sqrt(hd)) = exp2(x * scale_log2).
    const float scale_log2 = rsqrtf((float)hd) * 1.4426950408889634f;
    // ldmatrix row addresses of this lane. Q (A operand), matrices (rows 0-7 | 8-15) x (cols 0-7 |
    // 8-15) in the order of the A registers; K (B operand, keys along n), matrices (keys 0-7,
    // dims 0-7 | 8-15), then keys 8-15: registers 0, 1 are B of the first 8 keys, 2, 3 of the
    // next; V (B operand, keys along k, transposed), matrices (keys 0-7 | 8-15) of dims 0-7, then
    // of dims 8-15: registers 0, 1 are B of the first 8 dims, 2, 3 of the next.
    const int m = lane >> 3, r8 = lane & 7;
    const uint32_t q_lane = q_tile + (uint32_t)((warp * 16 + r8 + (m & 1) * 8) * STRIDE + (m >> 1) * 8) * 2;
    const uint32_t k_lane = k_tile + (uint32_t)((r8 + (m >> 1) * 8) * STRIDE + (m & 1) * 8) * 2;
    const uint32_t v_lane = v_tile + (uint32_t)((r8 + (m & 1) * 8) * STRIDE + (m >> 1) * 8) * 2;

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float row_max[2] = {-INFINITY, -INFINITY};  // raw scores (before the 1/sqrt(hd) scale)
    float row_sum[2] = {0.0f, 0.0f};            // this thread's columns only, summed over the quad at the end
    uint32_t p[PREFILL_KEY_TILE / 16][4];        // P of the step as A fragments, 16 keys each

    const int key_tiles = (key_end + PREFILL_KEY_TILE - 1) / PREFILL_KEY_TILE;
    for (int kt = 0; kt < key_tiles; ++kt) {
        const int first = kt * PREFILL_KEY_TILE;
        const bool active = warp_has_rows && first <= warp_limit;  // warp-uniform
        cp_async_wait<0>();
        __syncthreads();  // K tile kt (and at kt = 0 the Q tile) in place; every warp done with V tile kt - 1
        prefill_stage_keys<D>(v_tile, v_cache, kv_stride, hd, first, key_end);
        cp_async_commit();
        if (active) {
            float s[KEY_NTILES][4];
#pragma unroll
            for (int n = 0; n < KEY_NTILES; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) {
                uint32_t a[4];
                ldmatrix_x4(a, q_lane + ks * 32);
#pragma unroll
                for (int n = 0; n < KEY_NTILES; n += 2) {
                    uint32_t b[4];
                    ldmatrix_x4(b, k_lane + (uint32_t)(n * 8 * STRIDE + ks * 16) * 2);
                    mma_bf16_16816(s[n], a, b[0], b[1]);
                    mma_bf16_16816(s[n + 1], a, b[2], b[3]);
                }
            }
            // Causal mask (also covers keys past key_end) where some key may pass the tile's first limit.
            if (first + PREFILL_KEY_TILE - 1 > p0 + tile0) {
#pragma unroll
                for (int n = 0; n < KEY_NTILES; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (first + n * 8 + 2 * c + (e & 1) > limit[e >> 1]) s[n][e] = -INFINITY;
            }
            // Online softmax. Key 0 lies in the first tile and is seen by every row, so the new
            // maximum is finite from the first step on.
            float new_max[2] = {row_max[0], row_max[1]};
#pragma unroll
            for (int n = 0; n < KEY_NTILES; ++n) {
                new_max[0] = fmaxf(new_max[0], fmaxf(s[n][0], s[n][1]));
                new_max[1] = fmaxf(new_max[1], fmaxf(s[n][2], s[n][3]));
            }
            float correction[2], offset[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                new_max[h] = fmaxf(new_max[h], __shfl_xor_sync(0xffffffffu, new_max[h], 1));
                new_max[h] = fmaxf(new_max[h], __shfl_xor_sync(0xffffffffu, new_max[h], 2));
                correction[h] = exp2f((row_max[h] - new_max[h]) * scale_log2);  // 0 on the first step
                row_max[h] = new_max[h];
                offset[h] = new_max[h] * scale_log2;
                row_sum[h] *= correction[h];
            }
#pragma unroll
            for (int n = 0; n < KEY_NTILES; ++n) {
                const float e0 = exp2f(fmaf(s[n][0], scale_log2, -offset[0]));
                const float e1 = exp2f(fmaf(s[n][1], scale_log2, -offset[0]));
                const float e2 = exp2f(fmaf(s[n][2], scale_log2, -offset[1]));
                const float e3 = exp2f(fmaf(s[n][3], scale_log2, -offset[1]));
                row_sum[0] += e0 + e1;
                row_sum[1] += e2 + e3;
                // S tile n is keys 8n .. 8n + 7: the low (n even) or high (n odd) 8 columns of P's
                // A fragment for keys 16 (n / 2) .. + 15.
                p[n / 2][(n & 1) * 2] = pack_bf16(e0, e1);
                p[n / 2][(n & 1) * 2 + 1] = pack_bf16(e2, e3);
            }
#pragma unroll
            for (int i = 0; i < D / 8; ++i) {
                o[i][0] *= correction[0];
                o[i][1] *= correction[0];
                o[i][2] *= correction[1];
                o[i][3] *= correction[1];
            }
        }
        cp_async_wait<0>();
        __syncthreads();  // V tile kt in place; every warp done with K tile kt
        if (kt + 1 < key_tiles) {
            prefill_stage_keys<D>(k_tile, k_cache, kv_stride, hd, first + PREFILL_KEY_TILE, key_end);
            cp_async_commit();
        }
        if (active) {
#pragma unroll
            for (int j = 0; j < PREFILL_KEY_TILE / 16; ++j)
#pragma unroll
                for (int i = 0; i < D / 8; i += 2) {
                    uint32_t b[4];
                    ldmatrix_x4_trans(b, v_lane + (uint32_t)(j * 16 * STRIDE + i * 8) * 2);
                    mma_bf16_16816(o[i], p[j], b[0], b[1]);
                    mma_bf16_16816(o[i + 1], p[j], b[2], b[3]);
                }
        }
    }

    const int width = attention_proj_width(d);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float sum = row_sum[h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int row = row_lo + 8 * h;
        if (row >= rows) continue;
        const int t = tile0 + row;
        const float* gate = proj + (size_t)t * width + (size_t)head * 2 * hd + hd;
        float* dst = out + ((size_t)t * d.heads + head) * hd;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            const int col = i * 8 + 2 * c;
            if (col >= hd) break;  // hd is a multiple of 8: col + 1 < hd too
            const float2 gv = *reinterpret_cast<const float2*>(gate + col);
            *reinterpret_cast<float2*>(dst + col) =
                make_float2(o[i][2 * h] / sum * sigmoid(gv.x), o[i][2 * h + 1] / sum * sigmoid(gv.y));
        }
    }
}

extern "C" __global__ void __launch_bounds__(PREFILL_THREADS) attention_prefill(AttentionDims d, const float* q,
                                                                               const bf16* k_cache,
                                                                               const bf16* v_cache,
                                                                               const int* position,
                                                                               const float* proj, int tokens,
                                                                               float* out) {
    // head_dim: a multiple of 8 (16-byte copies of cache rows), at most 256; the backend takes
    // multiples of 32.
    if (d.head_dim <= 32) attention_prefill_impl<32>(d, q, k_cache, v_cache, position, proj, tokens, out);
    else if (d.head_dim <= 64) attention_prefill_impl<64>(d, q, k_cache, v_cache, position, proj, tokens, out);
    else if (d.head_dim <= 128) attention_prefill_impl<128>(d, q, k_cache, v_cache, position, proj, tokens, out);
    else attention_prefill_impl<256>(d, q, k_cache, v_cache, position, proj, tokens, out);
}

//! Matrix products on tensor cores for many tokens at once (the prefill path's projections):
//! Y = X · Wᵀ with W in MLX 4- or 8-bit, dequantised inside the product, or dense bf16
//! (kernels/gemm.cu).

use anyhow::{Result, ensure};

use super::weights::{DeviceWeight, ptr};
use super::{CudaBackend, MmaRows, arg, cfg};
use crate::model::{Matrix, Storage};

/// Weight rows one block covers, tokens per block of a dense and of a grouped product (narrow
/// and wide tiles), threads and pipeline stages (GEMM_ROWS, GEMM_DENSE_TOKENS, GEMM_GROUP_TOKENS,
/// GEMM_GROUP_TOKENS_WIDE, GEMM_THREADS, gemm_stages in gemm.cu).
pub(super) const GEMM_ROWS: usize = 128;
const GEMM_DENSE_TOKENS: usize = 128;
pub(super) const GEMM_GROUP_TOKENS: usize = 64;
pub(super) const GEMM_GROUP_TOKENS_WIDE: usize = 128;
pub(super) const GEMM_THREADS: u32 = 128;
/// Pipeline stages for `bits`-bit weights: three for bf16, four otherwise (gemm_stages).
fn gemm_stages(bits: usize) -> usize {
    if bits == 16 { 3 } else { 4 }
}
/// Inputs per pipeline stage (GEMM_K).
const GEMM_K: usize = 64;

/// Dynamic shared memory of `gemm_q` and `gemm_q_grouped` for `bits`-bit weights and `tokens`
/// per block: the stages' weight rows, token rows, and the words holding each row's scales and
/// biases, plus the slack that aligns the stages to 1024 bytes (the swizzled layout's unit).
pub(super) fn gemm_smem_bytes(bits: usize, tokens: usize) -> u32 {
    let weights = GEMM_ROWS * GEMM_K * bits / 8;
    let inputs = tokens * GEMM_K * 2;
    let scales_biases = GEMM_ROWS * 2 * 2 * 4;
    (gemm_stages(bits) * (weights + inputs + scales_biases) + 1024) as u32
}

/// Whether the tensor-core products take `w`: MLX 4- or 8-bit with groups of at least 32
/// inputs, or dense bf16 whose values fp16 holds (they go to the tensor cores in fp16).
pub(super) fn on_tensor_cores(w: &DeviceWeight) -> bool {
    (w.bits == 16 && w.fits_fp16) || ((w.bits == 4 || w.bits == 8) && w.group >= 32)
}

impl CudaBackend {
    /// `x` ([tokens, w.cols], row-major) times the transpose of `w` (4- or 8-bit, or dense, which
    /// goes to the GPU in bf16 and must fit fp16) on the GPU: [tokens, w.rows], row-major, the
    /// products split `splits` ways along k (1: not split; more: the partial sums the router's
    /// product leaves, added up here). Uploads both, so it serves checks and measurements;
    /// prefill runs the same kernels on device buffers.
    pub fn matmul_q(
        &self,
        w: &Matrix,
        x: &[f32],
        tokens: usize,
        splits: usize,
    ) -> Result<Vec<f32>> {
        if let Storage::Quantized(q) = &w.storage {
            ensure!(
                (q.spec.bits == 4 || q.spec.bits == 8) && q.spec.group_size >= 32,
                "matmul_q takes 4- or 8-bit weights with groups of at least 32 (got {} bits, group {})",
                q.spec.bits,
                q.spec.group_size
            );
        }
        ensure!(
            tokens > 0 && x.len() == tokens * w.cols,
            "x holds {} values, not {tokens} tokens of {}",
            x.len(),
            w.cols
        );
        ensure!(splits > 0, "a product runs in at least one split");
        let s = &self.stream;
        let weight = DeviceWeight::upload(s, self.scales, &[w])?;
        ensure!(
            on_tensor_cores(&weight),
            "matmul_q: a dense matrix with values beyond fp16's range stays off the tensor cores"
        );
        let x_dev = s.clone_htod(x)?;
        let x16 = s.alloc_zeros::<u16>(x.len())?;
        let xscale = s.alloc_zeros::<f32>(tokens)?;
        let y = s.alloc_zeros::<f32>(splits * tokens * w.rows)?;
        let (x16p, sp) = (ptr(&x16, s), ptr(&xscale, s));
        self.rows_to_half(ptr(&x_dev, s), w.cols, None, weight.bits, tokens, x16p, sp)?;
        self.gemm_rows_split(&weight, x16p, sp, tokens, ptr(&y, s), false, splits)?;
        let partial = s.clone_dtoh(&y)?;
        let mut out = partial[..tokens * w.rows].to_vec();
        for slice in partial.chunks_exact(tokens * w.rows).skip(1) {
            out.iter_mut().zip(slice).for_each(|(o, p)| *o += p);
        }
        Ok(out)
    }

    /// x16, xscale = the `n` rows of `cols` floats at `x` (RMS-normalised and scaled by `norm`
    /// when given) in fp16, each divided by its power-of-two scale, in the order the tensor-core
    /// products of `bits`-bit weights read (rows_to_half).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rows_to_half(
        &self,
        x: u64,
        cols: usize,
        norm: Option<u64>,
        bits: usize,
        n: usize,
        x16: u64,
        xscale: u64,
    ) -> Result<()> {
        let rows = MmaRows {
            x,
            x_stride: cols,
            norm: norm.unwrap_or(0),
            weight: None,
        };
        self.stage_half(&rows, cols, bits, n, n, x16, cols, xscale)
    }

    /// `rows_to_half` for the `tokens` rows of `rows` (x at any stride; each token's output
    /// weight, if any, folded into its xscale), into rows of x16 `stride` halves apart, rows
    /// `tokens` to `padded` zeros (a product's tiles padded to whole blocks of tokens).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn stage_half(
        &self,
        rows: &MmaRows,
        cols: usize,
        bits: usize,
        tokens: usize,
        padded: usize,
        x16: u64,
        stride: usize,
        xscale: u64,
    ) -> Result<()> {
        let (x_stride, norm, eps) = (rows.x_stride as i32, rows.norm, self.config.rms_norm_eps);
        let (weight, weight_stride) = rows.weight.map_or((0, 0), |(p, s)| (p, s as i32));
        let (cols, bits, tokens, stride) = (cols as i32, bits as i32, tokens as i32, stride as i32);
        // SAFETY: x holds `tokens` rows of cols floats x_stride apart (the row weights, if any,
        // `tokens` entries), x16 `padded` rows of `stride` >= cols halves, xscale `padded` floats.
        unsafe {
            self.launch(
                "rows_to_half",
                &self.k.rows_to_half,
                cfg(padded as u32, 1, 256, 0),
                &mut [
                    arg(&rows.x),
                    arg(&cols),
                    arg(&x_stride),
                    arg(&norm),
                    arg(&eps),
                    arg(&bits),
                    arg(&weight),
                    arg(&weight_stride),
                    arg(&tokens),
                    arg(&x16),
                    arg(&stride),
                    arg(&xscale),
                ],
            )
        }
    }

    /// y (+)= x16 · wᵀ for `n` rows already in fp16 (gemm_q).
    pub(super) fn gemm_rows(
        &self,
        w: &DeviceWeight,
        x16: u64,
        xscale: u64,
        n: usize,
        y: u64,
        accumulate: bool,
    ) -> Result<()> {
        self.gemm_rows_split(w, x16, xscale, n, y, accumulate, 1)
    }

    /// As `gemm_rows` in `splits` equal runs of k: with more than one, y[s] = the sum over run s,
    /// slices of n rows of w.rows one after the other in y, for the reader to add up (and no
    /// accumulating): products of few rows (the router) make few blocks, each with all of k to
    /// go through otherwise.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm_rows_split(
        &self,
        w: &DeviceWeight,
        x16: u64,
        xscale: u64,
        n: usize,
        y: u64,
        accumulate: bool,
        splits: usize,
    ) -> Result<()> {
        self.gemm_dense(
            [w; 2],
            1,
            (x16, xscale),
            n,
            [y; 2],
            accumulate,
            splits as u32,
        )
    }

    /// y[i] = x16 · w[i]ᵀ for two matrices (the shared expert's gate and up): one launch when
    /// they have the same shape and format, else one each.
    pub(super) fn gemm_rows_pair(
        &self,
        w: [&DeviceWeight; 2],
        x16: u64,
        xscale: u64,
        n: usize,
        y: [u64; 2],
    ) -> Result<()> {
        let format = |w: &DeviceWeight| (w.rows, w.cols, w.bits, w.group);
        if format(w[0]) == format(w[1]) {
            self.gemm_dense(w, 2, (x16, xscale), n, y, false, 1)
        } else {
            self.gemm_rows(w[0], x16, xscale, n, y[0], false)?;
            self.gemm_rows(w[1], x16, xscale, n, y[1], false)
        }
    }

    /// One gemm_q launch: `z` products (1 or 2) of w[i] by the same inputs into y[i], each in
    /// `splits` splits of k (along grid.z).
    #[allow(clippy::too_many_arguments)]
    fn gemm_dense(
        &self,
        w: [&DeviceWeight; 2],
        z: u32,
        (x16, xscale): (u64, u64),
        n: usize,
        y: [u64; 2],
        accumulate: bool,
        splits: u32,
    ) -> Result<()> {
        ensure!(
            splits == 1 || !accumulate,
            "split products write partial sums; they cannot accumulate"
        );
        let s = &self.stream;
        let (desc, desc2) = (w[0].desc(s), w[1].desc(s));
        let (tokens, acc, splits32) = (n as i32, accumulate as i32, splits as i32);
        let mut launch = cfg(
            n.div_ceil(GEMM_DENSE_TOKENS) as u32,
            w[0].rows.div_ceil(GEMM_ROWS) as u32,
            GEMM_THREADS,
            gemm_smem_bytes(w[0].bits, GEMM_DENSE_TOKENS),
        );
        launch.grid_dim.2 = z * splits;
        // SAFETY: x16 holds n rows of w.cols, y[i] n rows of w.rows; the kernel clamps its reads.
        unsafe {
            self.launch(
                "gemm_q",
                &self.k.gemm_q,
                launch,
                &mut [
                    arg(&desc),
                    arg(&desc2),
                    arg(&x16),
                    arg(&xscale),
                    arg(&tokens),
                    arg(&y[0]),
                    arg(&y[1]),
                    arg(&acc),
                    arg(&splits32),
                ],
            )
        }
    }

    /// The fp16 tensor-core rate (FLOP/s) this GPU sustains for the wgmma m64n64k16 products
    /// the prefill kernels use, measured with products on registers and shared memory only
    /// (wgmma_peak).
    pub fn tensor_core_rate(&self) -> Result<f64> {
        const ITERS: i32 = 1 << 10;
        const FLOP_PER_PRODUCT: f64 = 2.0 * 64.0 * 64.0 * 16.0;
        let s = &self.stream;
        let out = s.alloc_zeros::<f32>(128)?;
        let out_ptr = ptr(&out, s);
        let blocks = self.k.num_sms * 4;
        let run = |iters: i32| -> Result<f64> {
            let start = std::time::Instant::now();
            // SAFETY: wgmma_peak writes at most 128 floats of out.
            unsafe {
                self.launch(
                    "wgmma_peak",
                    &self.k.wgmma_peak,
                    cfg(blocks, 1, 128, 0),
                    &mut [arg(&iters), arg(&out_ptr)],
                )
            }?;
            s.synchronize()?;
            Ok(start.elapsed().as_secs_f64())
        };
        run(16)?;
        let secs = run(ITERS)?;
        let products = blocks as f64 * ITERS as f64 * 8.0;
        Ok(products * FLOP_PER_PRODUCT / secs)
    }
}

#[cfg(test)]
mod tests {
    use super::super::MAX_DYNAMIC_SHARED_BYTES;
    use super::*;

    #[test]
    fn gemm_stages_fit_the_shared_memory_they_are_launched_with() {
        // An H200 SM has 228 KB of shared memory, 1 KB of it reserved per block.
        let sm = 228 * 1024;
        let dense = gemm_smem_bytes(4, GEMM_DENSE_TOKENS) as usize;
        let grouped = gemm_smem_bytes(4, GEMM_GROUP_TOKENS) as usize;
        let wide = gemm_smem_bytes(4, GEMM_GROUP_TOKENS_WIDE) as usize;
        // Static shared memory: the tile's token tables (three words per token), once per width
        // the kernel is compiled for (4, 8 and 16 bits).
        let tables = |tokens: usize| 3 * 3 * 4 * tokens;
        // 4-bit products run two dense, three grouped or two wide grouped blocks per SM (their
        // register budgets).
        let dense = dense + tables(GEMM_DENSE_TOKENS);
        let grouped = grouped + tables(GEMM_GROUP_TOKENS);
        let wide = wide + tables(GEMM_GROUP_TOKENS_WIDE);
        assert!(2 * (dense + 1024) <= sm, "{dense}");
        assert!(3 * (grouped + 1024) <= sm, "{grouped}");
        assert!(2 * (wide + 1024) <= sm, "{wide}");
        // 8-bit stages are larger but still launchable; bf16's three stages fit two blocks per SM
        // at every width.
        for tokens in [GEMM_DENSE_TOKENS, GEMM_GROUP_TOKENS, GEMM_GROUP_TOKENS_WIDE] {
            assert!(gemm_smem_bytes(8, tokens) as usize <= MAX_DYNAMIC_SHARED_BYTES);
            assert!(gemm_smem_bytes(8, tokens) > gemm_smem_bytes(4, tokens));
            let bf16 = gemm_smem_bytes(16, tokens) as usize;
            assert!(2 * (bf16 + tables(tokens) + 1024) <= sm, "{bf16}");
        }
    }
}

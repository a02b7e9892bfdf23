//! Matrix products on tensor cores for many tokens at once (the prefill path's projections):
//! Y = X · Wᵀ with W in MLX 4-bit, dequantised inside the product (kernels/gemm.cu).

use anyhow::{Result, ensure};
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::CudaBackend;
use super::weights::{DeviceWeight, ptr};
use crate::model::{Matrix, Storage};

/// Weight rows and tokens one `gemm_q4` block covers (GEMM_ROWS, GEMM_TOKENS in gemm.cu).
pub(super) const GEMM_ROWS: usize = 128;
pub(super) const GEMM_TOKENS: usize = 64;

impl CudaBackend {
    /// `x` ([tokens, w.cols], row-major) times the transpose of the 4-bit matrix `w` on the GPU:
    /// [tokens, w.rows], row-major. Uploads both, so it serves checks and measurements; the
    /// prefill path will run the same kernels on device buffers.
    pub fn matmul_q4(&self, w: &Matrix, x: &[f32], tokens: usize) -> Result<Vec<f32>> {
        let Storage::Quantized(q) = &w.storage else {
            anyhow::bail!("matmul_q4 takes a 4-bit matrix, not a dense one");
        };
        ensure!(
            q.spec.bits == 4 && q.spec.group_size >= 32,
            "matmul_q4 takes 4-bit weights with groups of at least 32 (got {} bits, group {})",
            q.spec.bits,
            q.spec.group_size
        );
        ensure!(
            tokens > 0 && x.len() == tokens * w.cols,
            "x holds {} values, not {tokens} tokens of {}",
            x.len(),
            w.cols
        );
        let s = &self.stream;
        let weight = DeviceWeight::upload(s, &[w])?;
        let desc = weight.desc(s);
        let x_dev = s.clone_htod(x)?;
        let x16 = s.alloc_zeros::<u16>(x.len())?;
        let xscale = s.alloc_zeros::<f32>(tokens)?;
        let y = s.alloc_zeros::<f32>(tokens * w.rows)?;
        let (xp, x16p, sp, yp) = (ptr(&x_dev, s), ptr(&x16, s), ptr(&xscale, s), ptr(&y, s));
        let (cols, n) = (w.cols as i32, tokens as i32);
        let accumulate = 0i32;
        let (no_norm, eps) = (0u64, 0.0f32);
        let mut b = s.launch_builder(&self.k.rows_to_half);
        b.arg(&xp)
            .arg(&cols)
            .arg(&no_norm)
            .arg(&eps)
            .arg(&x16p)
            .arg(&sp);
        let cfg = LaunchConfig {
            grid_dim: (tokens as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: x, x16 hold tokens * cols values, xscale tokens.
        unsafe { b.launch(cfg) }?;
        let mut b = s.launch_builder(&self.k.gemm_q4);
        b.arg(&desc)
            .arg(&x16p)
            .arg(&sp)
            .arg(&n)
            .arg(&yp)
            .arg(&accumulate);
        let cfg = LaunchConfig {
            grid_dim: (
                tokens.div_ceil(GEMM_TOKENS) as u32,
                w.rows.div_ceil(GEMM_ROWS) as u32,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: y holds tokens * rows values; the kernel clamps its reads to the shapes.
        unsafe { b.launch(cfg) }?;
        Ok(s.clone_dtoh(&y)?)
    }
}

//! The mat-vec launches: one token's product by the integer-dot kernels (`matvec`,
//! `matvec_two_rows`), a few tokens' in one pass (`matvec_tokens`), and a batch's on tensor
//! cores (`matvec_mma`, its inputs staged in fp16 first), each weight row read once per launch.

use anyhow::{Result, ensure};
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};

use super::shapes::*;
use super::weights::{DeviceWeight, ptr};
use super::{CudaBackend, arg, cfg};
use crate::model::Matrix;

impl CudaBackend {
    /// y = W · (x, RMS-normalised by `norm` when given) for `tokens` consecutive rows of x and y;
    /// with `add`, y = add + W · x (rows as y's; `add` may be y itself). One token, or weights
    /// `matvec_mma` does not take: the integer-dot mat-vec, a grid row per token; several:
    /// `matvec_mma` on tensor cores, each weight row read once per MMA_TOKENS tokens, its inputs
    /// staged in the decode scratch. At most one wave of persistent blocks. `role` names the
    /// launch (the weight's part in the model) in errors and the critical path.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matvec(
        &self,
        role: &'static str,
        w: &DeviceWeight,
        x: u64,
        norm: Option<u64>,
        y: u64,
        add: Option<u64>,
        tokens: usize,
    ) -> Result<()> {
        let staging = self.scratch.mma_staging(&self.stream);
        self.matvec_staged(role, w, x, norm, y, add, tokens, staging)
    }

    /// `matvec` with `matvec_mma`'s inputs staged in `staging` (prefill's own scratch: a prefill
    /// may be issued while another thread's batched decode step is queued on the stream).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matvec_staged(
        &self,
        role: &'static str,
        w: &DeviceWeight,
        x: u64,
        norm: Option<u64>,
        y: u64,
        add: Option<u64>,
        tokens: usize,
        staging: MmaStaging,
    ) -> Result<()> {
        let s = &self.stream;
        let desc = w.desc(s);
        let norm = norm.unwrap_or(0);
        let eps = self.config.rms_norm_eps;
        let acc = add.unwrap_or(0);
        let warps = MATVEC_THREADS as usize / 32;
        // The integer-dot kernels for one token and for a few: two rows per warp pass for short rows.
        let rows_per_warp = matvec_rows_per_warp(w.cols, w.bits);
        let (kernel, tokens_kernel) = if rows_per_warp == 2 {
            (&self.k.matvec_two_rows, &self.k.matvec_two_rows_tokens)
        } else {
            (&self.k.matvec, &self.k.matvec_tokens)
        };
        if let Some(per_block) = self.matvec_tokens_per_block(w, tokens) {
            let smem = matvec_tokens_smem(w.cols, per_block);
            // One wave: as many blocks as fit on an SM beside each other (registers and
            // staging may allow fewer than the one-token kernels' MATVEC_BLOCKS_PER_SM).
            let per_sm = tokens_kernel
                .occupancy_max_active_blocks_per_multiprocessor(
                    MATVEC_THREADS,
                    smem as usize,
                    None,
                )?
                .max(1) as usize;
            let blocks = w
                .rows
                .div_ceil(warps * rows_per_warp)
                .min(self.k.num_sms as usize * per_sm);
            let (tokens32, per_block32) = (tokens as i32, per_block as i32);
            // SAFETY: x and y hold `tokens` rows of w.cols and w.rows floats; each block stages
            // per_block of them in `smem` bytes (matvec_tokens_per_block keeps that in bounds).
            return unsafe {
                self.launch(
                    role,
                    tokens_kernel,
                    cfg(
                        blocks as u32,
                        tokens.div_ceil(per_block) as u32,
                        MATVEC_THREADS,
                        smem,
                    ),
                    &mut [
                        arg(&desc),
                        arg(&x),
                        arg(&norm),
                        arg(&eps),
                        arg(&y),
                        arg(&acc),
                        arg(&tokens32),
                        arg(&per_block32),
                    ],
                )
            };
        }
        if self.matvec_takes_mma(w, tokens) {
            let rows = MmaRows {
                x,
                x_stride: w.cols,
                norm,
                weight: None,
            };
            return self.matvec_mma(role, w, rows, y, add, tokens, staging);
        }
        let resident = self.k.num_sms as usize * MATVEC_BLOCKS_PER_SM;
        let blocks = w.rows.div_ceil(warps * rows_per_warp).min(resident);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, tokens as u32, 1),
            block_dim: (MATVEC_THREADS, 1, 1),
            shared_mem_bytes: staged_bytes(&[w.cols]),
        };
        // SAFETY: x and y hold `tokens` rows of w.cols and w.rows floats (scratch sized at
        // construction for these shapes).
        unsafe {
            self.launch(
                role,
                kernel,
                cfg,
                &mut [
                    arg(&desc),
                    arg(&x),
                    arg(&norm),
                    arg(&eps),
                    arg(&y),
                    arg(&acc),
                ],
            )
        }?;
        Ok(())
    }

    /// y[t] (+)= W · rows' x[t] on tensor cores (`matvec_mma`, blocks of up to 32 tokens, each
    /// weight row read once per block) for `tokens` rows; `w` of a layout `mma_takes`. The
    /// inputs are first staged in fp16 in `staging` (`stage_half`), once for every block.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matvec_mma(
        &self,
        role: &'static str,
        w: &DeviceWeight,
        rows: MmaRows,
        y: u64,
        add: Option<u64>,
        tokens: usize,
        staging: MmaStaging,
    ) -> Result<()> {
        let s = &self.stream;
        let desc = w.desc(s);
        let warps = MATVEC_THREADS as usize / 32;
        let block_tiles = mma_block_tiles(tokens, w.cols);
        // Each block copies its tokens' rows as they lie in memory: whole blocks of tokens,
        // rows of cols + 4 halves (see mma_smem).
        let padded = tokens.next_multiple_of(MMA_TOKENS * block_tiles);
        let stride = w.cols + 4;
        ensure!(
            padded <= staging.rows && padded * stride <= staging.halves,
            "{role}: {tokens} rows of {} inputs exceed the staging of the tensor-core product",
            w.cols
        );
        self.stage_half(
            &rows,
            w.cols,
            w.bits,
            tokens,
            padded,
            staging.x16,
            stride,
            staging.xscale,
        )?;
        let kernel = &self.k.matvec_mma[block_tiles.trailing_zeros() as usize];
        let smem = mma_smem(w.cols, block_tiles);
        // One wave of persistent blocks: as many as fit on an SM beside each other, shared by
        // the grid's rows of tokens (a second wave would start each block's chain again).
        let per_sm = kernel
            .occupancy_max_active_blocks_per_multiprocessor(MATVEC_THREADS, smem as usize, None)?
            .max(1) as usize;
        let block_rows = tokens.div_ceil(MMA_TOKENS * block_tiles);
        let resident = (self.k.num_sms as usize * per_sm).div_ceil(block_rows);
        let (tiles, ksplit) = mma_split(w.rows, w.cols, w.bits, resident * warps);
        let blocks = tiles.div_ceil(warps / ksplit).min(resident);
        let (acc, tokens32, ksplit32) = (add.unwrap_or(0), tokens as i32, ksplit as i32);
        // SAFETY: staging holds `padded` rows of `stride` halves and their scales (checked
        // above), y `tokens` rows of w.rows; the weights are of a layout matvec_mma takes
        // (mma_takes), its staging in mma_smem bytes.
        unsafe {
            self.launch(
                role,
                kernel,
                cfg(blocks as u32, block_rows as u32, MATVEC_THREADS, smem),
                &mut [
                    arg(&desc),
                    arg(&staging.x16),
                    arg(&staging.xscale),
                    arg(&y),
                    arg(&acc),
                    arg(&tokens32),
                    arg(&ksplit32),
                ],
            )
        }
    }

    /// Whether `matvec` multiplies `tokens` rows of inputs by `w` on tensor cores (`matvec_mma`,
    /// inputs rounded to fp16) rather than by the integer dot of each sequence's own step.
    pub(super) fn matvec_takes_mma(&self, w: &DeviceWeight, tokens: usize) -> bool {
        tokens > 1
            && mma_takes(w.bits, w.group, w.cols)
            && self.matvec_tokens_per_block(w, tokens).is_none()
    }

    /// Tokens per block of `matvec_tokens` for `tokens` rows of `w`'s inputs, or None where the
    /// batch is better served otherwise. Weights `matvec_mma` does not take (bf16): up to
    /// MATVEC_TOKENS tokens a block, each row read once instead of once per token. Weights it
    /// takes: two tokens, and only for matrices of a few passes of the one-token grid, whose time
    /// is latency that the tensor-core tiles (8 tokens wide, 6 of them idle) only lengthen; a
    /// tall matrix (lm_head) is bandwidth-bound, where the integer dot's arithmetic per token
    /// costs more (measured on the H200: `docs/BENCHMARKS.md`, batched decode).
    fn matvec_tokens_per_block(&self, w: &DeviceWeight, tokens: usize) -> Option<usize> {
        let most = if mma_takes(w.bits, w.group, w.cols) {
            let warps = MATVEC_THREADS as usize / 32;
            let pass = self.k.num_sms as usize
                * MATVEC_BLOCKS_PER_SM
                * warps
                * matvec_rows_per_warp(w.cols, w.bits);
            if w.rows > MATVEC_TOKENS_MAX_PASSES * pass {
                return None;
            }
            2
        } else {
            MATVEC_TOKENS
        };
        if !(2..=most).contains(&tokens) {
            return None;
        }
        let fit = (1..=MATVEC_TOKENS)
            .take_while(|&n| matvec_tokens_smem(w.cols, n) as usize <= MAX_DYNAMIC_SHARED_BYTES)
            .last()?;
        let block_rows = tokens.div_ceil(fit);
        Some(tokens.div_ceil(block_rows))
    }

    /// W x for one token by the decode mat-vec (the integer dot for 4- and 8-bit weights), W
    /// and x uploaded: for checks against the dequantised product.
    pub fn mat_vec(&self, w: &Matrix, x: &[f32]) -> Result<Vec<f32>> {
        ensure!(
            x.len() == w.cols,
            "x holds {} values, not the matrix's {} columns",
            x.len(),
            w.cols
        );
        ensure!(
            staged_bytes(&[w.cols]) as usize <= MAX_DYNAMIC_SHARED_BYTES,
            "a row of {} columns is too wide to stage",
            w.cols
        );
        let s = &self.stream;
        let weight = DeviceWeight::upload(s, self.scales, &[w])?;
        let x_dev = s.clone_htod(x)?;
        let y = s.alloc_zeros::<f32>(w.rows)?;
        self.matvec(
            "mat_vec",
            &weight,
            ptr(&x_dev, s),
            None,
            ptr(&y, s),
            None,
            1,
        )?;
        Ok(s.clone_dtoh(&y)?)
    }
}

/// The inputs of a `matvec_mma` product: rows of x `x_stride` floats apart, RMS-normalised by
/// the scale at `norm` unless it is 0, each token's products times a weight (`weight`: its
/// address and the floats between consecutive tokens' weights) when given.
pub(super) struct MmaRows {
    pub(super) x: u64,
    pub(super) x_stride: usize,
    pub(super) norm: u64,
    pub(super) weight: Option<(u64, usize)>,
}

/// Where `matvec_mma`'s inputs are staged in fp16 before the product: `halves` halves for rows
/// of inputs (cols + 4 halves each, the product's shared-memory layout, so that each block
/// copies its rows as they lie), `rows` scales.
#[derive(Clone, Copy)]
pub(super) struct MmaStaging {
    x16: u64,
    xscale: u64,
    halves: usize,
    rows: usize,
}

impl MmaStaging {
    pub(super) fn of(x16: &CudaSlice<u16>, xscale: &CudaSlice<f32>, s: &CudaStream) -> Self {
        Self {
            x16: ptr(x16, s),
            xscale: ptr(xscale, s),
            halves: x16.len(),
            rows: xscale.len(),
        }
    }

    /// Rows to allocate for products of up to `tokens` tokens (padded to whole blocks of
    /// MMA_TOKENS * MMA_MOST_TILES at most).
    pub(super) fn rows(tokens: usize) -> usize {
        tokens.next_multiple_of(MMA_TOKENS * MMA_MOST_TILES)
    }

    /// Halves to allocate for products of up to `tokens` tokens of up to `cols` inputs.
    pub(super) fn halves(tokens: usize, cols: usize) -> usize {
        Self::rows(tokens) * (cols + 4)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_core_mat_vec_staging_holds_every_block_of_tokens() {
        // matvec_mma stages whole blocks of tokens (the last one padded with zero rows), rows of
        // cols + 4 halves: what a batch of up to `most` tokens may ask for fits what is
        // allocated for `most`.
        for most in [1usize, 3, 8, 18, 32, 33, 64, 100] {
            for cols in [512, 2048, 4096] {
                for tokens in 1..=most {
                    let padded =
                        tokens.next_multiple_of(MMA_TOKENS * mma_block_tiles(tokens, cols));
                    assert!(
                        padded <= MmaStaging::rows(most),
                        "{tokens} of {most}, {cols}"
                    );
                    assert!(padded * (cols + 4) <= MmaStaging::halves(most, cols));
                    // Each block copies whole 16-byte pieces: its rows of cols + 4 halves.
                    let block = MMA_TOKENS * mma_block_tiles(tokens, cols) * (cols + 4) * 2;
                    assert_eq!(block % 16, 0, "{tokens} of {cols}");
                }
            }
        }
    }
}

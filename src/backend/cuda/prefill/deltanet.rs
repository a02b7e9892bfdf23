//! The Gated DeltaNet core over a prefill chunk: the causal conv and the q/k norms and gates in
//! parallel over the tokens, the recurrence in its chunkwise form (64-token sub-chunks as
//! tensor-core products, the fp32 state carried from one to the next) or, for heads those kernels
//! do not take, the sequential scan, then the gated norm in parallel again.

use anyhow::Result;

use super::PrefillScratch;
use crate::backend::cuda::{CudaBackend, DeltaNetParams, arg, cfg};
use crate::config::ModelConfig;

/// Tokens per sub-chunk of the chunkwise DeltaNet recurrence (GDN_CHUNK in deltanet.cu). Its
/// scratch holds whole sub-chunks.
pub(super) const GDN_CHUNK: usize = 64;

/// Consecutive tokens per thread of deltanet_conv_chunk (CONV_RUN in deltanet.cu).
const CONV_RUN: usize = 16;

/// Row stride of the state, U and V' tiles in `deltanet_chunk_state`'s shared memory
/// (GDN_STATE_STRIDE).
const GDN_STATE_STRIDE: usize = 40;
/// Threads of a `deltanet_chunk_state` block (16 warps, its launch bounds).
const GDN_STATE_THREADS: u32 = 512;
/// Row stride of the 64 x 64 token tiles in the chunkwise kernels' shared memory (GDN_A_STRIDE).
const GDN_A_STRIDE: usize = 68;

/// Whether `deltanet_scan` holds the model's heads: a lane keeps 4 of at most 128 key rows, a warp
/// 4 value columns.
fn scan_fits(c: &ModelConfig) -> bool {
    c.linear_key_head_dim <= 128
        && c.linear_key_head_dim.is_multiple_of(4)
        && c.linear_value_head_dim.is_multiple_of(4)
}

/// Whether the chunkwise kernels take the model's heads: key_dim and value_dim multiples of 16
/// (whole mma tiles, a multiple of 16 columns per state block) and at most 128 (a warp of the
/// state block per 16 state rows, a column of the forward substitution per thread). Implies
/// `scan_fits`.
fn chunked_fits(c: &ModelConfig) -> bool {
    let (kd, vd) = (c.linear_key_head_dim, c.linear_value_head_dim);
    kd <= 128 && vd <= 128 && kd.is_multiple_of(16) && vd.is_multiple_of(16)
}

impl CudaBackend {
    /// The DeltaNet core of a layer over the chunk's `n` tokens, from the input projection's
    /// output to the recurrence's gated output in `l.out`; leaves the conv ring and the state
    /// for the next chunk or decode.
    pub(super) fn deltanet_chunk(
        &self,
        ps: &PrefillScratch,
        l: &DeltaNetParams,
        n: usize,
    ) -> Result<()> {
        // deltanet_step records a single token's conv input in the ring itself; everything else
        // (the chunk kernels, or the step over several tokens) leaves it to deltanet_conv_ring.
        let recorded = if scan_fits(&self.config) {
            self.deltanet_prefill(ps, l, n)?;
            false
        } else {
            self.deltanet_step(l, n, 1)?;
            n == 1
        };
        if !recorded {
            let c = &self.config;
            let entries = n.min(c.linear_conv_kernel_dim) * c.linear_conv_dim();
            let n32 = n as i32;
            // SAFETY: the ring holds kernel rows of conv_dim floats.
            unsafe {
                self.launch(
                    "deltanet_conv_ring",
                    &self.k.deltanet_conv_ring,
                    cfg(entries.div_ceil(256).min(1024) as u32, 1, 256, 0),
                    &mut [
                        arg(l.dims),
                        arg(&l.proj),
                        arg(&l.conv),
                        arg(&l.position),
                        arg(&n32),
                    ],
                )
            }?;
        }
        Ok(())
    }

    /// DeltaNet over a chunk: conv and norms in parallel over the tokens, the recurrence in the
    /// chunkwise form (`deltanet_chunkwise`) where it takes the heads, else in `deltanet_scan`, the
    /// gated norm in parallel again.
    fn deltanet_prefill(&self, ps: &PrefillScratch, l: &DeltaNetParams, n: usize) -> Result<()> {
        let c = &self.config;
        let m = &ps.mixer;
        let (act, gates, raw) = (m.gdn_act, m.gdn_gates, m.gdn_raw);
        let n32 = n as i32;
        // SAFETY (all launches in this function): the chunk buffers hold n rows of conv_dim
        // floats (act), value_heads gates and value_heads * value_dim outputs (raw, out); the
        // grids cover exactly the shapes the kernels document.
        unsafe {
            self.launch(
                "deltanet_conv_chunk",
                &self.k.deltanet_conv_chunk,
                cfg(
                    c.linear_conv_dim().div_ceil(256) as u32,
                    n.div_ceil(CONV_RUN) as u32,
                    256,
                    0,
                ),
                &mut [
                    arg(l.dims),
                    arg(&l.proj),
                    arg(&l.conv),
                    arg(&l.conv_w),
                    arg(&l.position),
                    arg(&n32),
                    arg(&act),
                ],
            )?;
            self.launch(
                "deltanet_norm_chunk",
                &self.k.deltanet_norm_chunk,
                cfg((n * c.linear_num_key_heads).div_ceil(8) as u32, 1, 256, 0),
                &mut [
                    arg(l.dims),
                    arg(&l.proj),
                    arg(&l.a_log),
                    arg(&l.dt_bias),
                    arg(&n32),
                    arg(&act),
                    arg(&gates),
                ],
            )?;
        }
        if chunked_fits(c) {
            self.deltanet_chunkwise(ps, l, n)?;
        } else {
            let warps = c.linear_value_dim() / 4;
            // SAFETY: as above; the state holds value_heads * key_dim * value_dim floats.
            unsafe {
                self.launch(
                    "deltanet_scan",
                    &self.k.deltanet_scan,
                    cfg(warps.div_ceil(8) as u32, 1, 256, 0),
                    &mut [
                        arg(l.dims),
                        arg(&act),
                        arg(&gates),
                        arg(&l.state),
                        arg(&n32),
                        arg(&raw),
                    ],
                )
            }?;
        }
        // SAFETY: as above.
        unsafe {
            self.launch(
                "deltanet_gated_norm",
                &self.k.deltanet_gated_norm,
                cfg((n * c.linear_num_value_heads).div_ceil(8) as u32, 1, 256, 0),
                &mut [
                    arg(l.dims),
                    arg(&raw),
                    arg(&l.proj),
                    arg(&l.norm),
                    arg(&n32),
                    arg(&l.out),
                ],
            )?;
        }
        Ok(())
    }

    /// The chunkwise recurrence over the `n` tokens in act and gates (see deltanet.cu): W, U and
    /// the cumulative decays per (value head, sub-chunk) in parallel, the state through the
    /// sub-chunks in order per (value head, 32 value columns, or 16 where value_dim is not a
    /// multiple of 32: gdn_state_cols in deltanet.cu), then the intra-sub-chunk part of
    /// the output per (value head, sub-chunk) in parallel again. Writes raw and the final state.
    fn deltanet_chunkwise(&self, ps: &PrefillScratch, l: &DeltaNetParams, n: usize) -> Result<()> {
        let c = &self.config;
        let m = &ps.mixer;
        let (act, gates, raw) = (m.gdn_act, m.gdn_gates, m.gdn_raw);
        let (gcum, w, values) = (m.gdn_gcum, m.gdn_w, m.gdn_values);
        let (heads, kd, vd) = (
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        );
        let sub_chunks = n.div_ceil(GDN_CHUNK) as u32;
        let n32 = n as i32;
        let prepare_smem =
            (GDN_CHUNK * (kd + 4 + vd) + GDN_CHUNK * GDN_A_STRIDE + 4 * GDN_CHUNK) * 4;
        let state_smem =
            (GDN_CHUNK * (3 * kd + 16) + (2 * GDN_CHUNK + kd) * GDN_STATE_STRIDE + 2 * GDN_CHUNK)
                * 4;
        let output_smem = ((2 * GDN_CHUNK * (kd + 4)).max(GDN_CHUNK * (vd + 8))
            + GDN_CHUNK * GDN_A_STRIDE
            + 2 * GDN_CHUNK)
            * 4;
        let state_cols = if vd.is_multiple_of(32) { 32 } else { 16 };
        let state_blocks = heads * vd / state_cols;
        // SAFETY (all three): act holds n rows of conv_dim floats, gates n rows of value_heads
        // float pairs, gcum n rows of value_heads doubles, w and values the chunk's rows rounded
        // up to whole sub-chunks (the kernels write the missing tokens' rows of the last one) of
        // value_heads * key_dim and value_heads * value_dim floats, raw n rows of value_heads *
        // value_dim, the state value_heads * key_dim * value_dim; chunked_fits holds, and the
        // dynamic shared memory is what the kernels document (at key_dim = value_dim = 128: 83,
        // 141 and 84 KiB, under MAX_DYNAMIC_SHARED_BYTES).
        unsafe {
            self.launch(
                "deltanet_chunk_prepare",
                &self.k.deltanet_chunk_prepare,
                cfg(heads as u32, sub_chunks, 256, prepare_smem as u32),
                &mut [
                    arg(l.dims),
                    arg(&act),
                    arg(&gates),
                    arg(&n32),
                    arg(&gcum),
                    arg(&w),
                    arg(&values),
                ],
            )?;
            self.launch(
                "deltanet_chunk_state",
                &self.k.deltanet_chunk_state,
                cfg(state_blocks as u32, 1, GDN_STATE_THREADS, state_smem as u32),
                &mut [
                    arg(l.dims),
                    arg(&act),
                    arg(&gcum),
                    arg(&w),
                    arg(&values),
                    arg(&l.state),
                    arg(&n32),
                    arg(&raw),
                ],
            )?;
            self.launch(
                "deltanet_chunk_output",
                &self.k.deltanet_chunk_output,
                cfg(heads as u32, sub_chunks, 256, output_smem as u32),
                &mut [
                    arg(l.dims),
                    arg(&act),
                    arg(&gcum),
                    arg(&values),
                    arg(&n32),
                    arg(&raw),
                ],
            )?;
        }
        Ok(())
    }
}

//! The MoE block over a prefill chunk: with 4- or 8-bit experts, routing, grouping by expert and
//! the experts' products per tile on tensor cores (`gemm_q_grouped`), all on the GPU; other
//! formats run the decode kernels with the chunk's tokens along a grid dimension. The grouped
//! routed experts also serve large decode batches (`routed_experts_grouped`).

use anyhow::Result;
use cudarc::driver::CudaSlice;

use super::{GroupedExperts, PrefillScratch};
use crate::backend::cuda::gemm::{
    GEMM_GROUP_TOKENS, GEMM_GROUP_TOKENS_WIDE, GEMM_ROWS, GEMM_THREADS, gemm_smem_bytes,
    on_tensor_cores,
};
use crate::backend::cuda::shapes::MoeDims;
use crate::backend::cuda::weights::{DeviceLayer, DeviceWeight, ptr};
use crate::backend::cuda::{CudaBackend, MoeBuffers, arg, cfg};
use crate::config::ModelConfig;

/// Splits of k for the router's product over a chunk: its few rows make few blocks, each with
/// all of k to go through (gemm_q's split k; moe_route adds the partial sums).
pub(super) const ROUTER_SPLITS: usize = 4;

/// Assignments per tile of the grouped MoE product for a chunk of `n` tokens: one block's tokens,
/// `gemm_q_grouped_wide`'s 128 once the experts get that many on average (a 4,096-token chunk of
/// the full model: 54.5 -> 52.7 ms of MoE at 4K on the H200), else `gemm_q_grouped`'s 64 (at
/// 512 and 1,536 tokens the wide tiles were slower: 17.3 vs 15.3 and 27.3 vs 26.2 ms).
pub(super) fn group_tile(c: &ModelConfig, n: usize) -> usize {
    if n * c.num_experts_per_tok >= GEMM_GROUP_TOKENS_WIDE * c.num_experts {
        GEMM_GROUP_TOKENS_WIDE
    } else {
        GEMM_GROUP_TOKENS
    }
}

/// Most tiles of `tile` assignments the experts' runs of a chunk of `n` tokens can make.
pub(super) fn max_group_tiles(c: &ModelConfig, n: usize, tile: usize) -> usize {
    (n * c.num_experts_per_tok).div_ceil(tile) + c.num_experts
}

impl CudaBackend {
    /// The MoE block of a layer for `n` token rows of the residual `x`, added to it.
    pub(super) fn moe_chunk(
        &self,
        ps: &PrefillScratch,
        layer: &DeviceLayer,
        x: u64,
        n: usize,
    ) -> Result<()> {
        let experts = [&layer.gate, &layer.up, &layer.down];
        let shared = [&layer.shared_gate, &layer.shared_up, &layer.shared_down];
        // One fp16 copy of the normed input serves the gate and up products of all experts, so
        // they must share a width (its permutation).
        let bits = layer.gate.bits;
        if experts
            .iter()
            .chain(&shared)
            .all(|w| on_tensor_cores(w) && w.bits == bits)
        {
            self.moe_chunk_grouped(ps, layer, x, n)
        } else {
            let buffers = MoeBuffers {
                router_logits: ps.moe.router_logits,
                act: ps.moe.act,
                ids: ps.moe.ids,
                weights: ps.moe.weights,
                routed_staged: 0,
                routing_ready: 0,
            };
            self.moe(layer, &buffers, x, n, None, None)
        }
    }

    /// The MoE block with the chunk's tokens grouped by expert: every expert's weights are read
    /// once per chunk and multiplied by all its tokens on tensor cores.
    fn moe_chunk_grouped(
        &self,
        ps: &PrefillScratch,
        layer: &DeviceLayer,
        x: u64,
        n: usize,
    ) -> Result<()> {
        let (c, s) = (&self.config, &self.stream);
        let p = |b: &CudaSlice<f32>| ptr(b, s);
        let post = p(&layer.post_norm);
        let (m, router) = (&ps.moe, ps.moe.router_logits);
        // Router first: a 4-bit router would reuse x16, which then holds the normed input.
        let splits = self.project_split(
            ps,
            &layer.router,
            x,
            Some(post),
            router,
            false,
            n,
            ROUTER_SPLITS,
        )?;
        let dims = MoeDims::new(c);
        let (ids, weights) = (m.ids, m.weights);
        let (splits32, split_stride) = (splits as i32, n * (c.num_experts + 1));
        // Prefill's router is not folded: its logits need no scale.
        let unscaled = 0u64;
        // SAFETY: router_logits holds `splits` slices of n rows, ids and weights n rows.
        unsafe {
            self.launch(
                "moe_route",
                &self.k.moe_route,
                cfg(n as u32, 1, 32, 0),
                &mut [
                    arg(&dims),
                    arg(&router),
                    arg(&splits32),
                    arg(&split_stride),
                    arg(&unscaled),
                    arg(&ids),
                    arg(&weights),
                ],
            )
        }?;
        let grouped = ps.grouped_experts(s);
        self.routed_experts_grouped(&grouped, layer, x, n, (ids, weights))?;
        let (x16, xs) = (grouped.x16, grouped.xscale);
        let (gate_rows, up_rows) = (m.gate_rows, m.up_rows);
        let (act16, actscale) = (m.act16, m.actscale);
        let top_k = c.num_experts_per_tok as i32;

        // The shared expert, dense over the chunk, weighted by its sigmoid gate.
        let shared_inter = c.shared_expert_intermediate_size;
        let shared_gate_up = [&layer.shared_gate, &layer.shared_up];
        self.gemm_rows_pair(shared_gate_up, x16, xs, n, [gate_rows, up_rows])?;
        self.swiglu(
            gate_rows,
            up_rows,
            weights,
            (1, top_k + 1, top_k),
            (shared_inter, layer.shared_down.bits),
            n,
            act16,
            actscale,
        )?;
        self.gemm_rows(&layer.shared_down, act16, actscale, n, x, true)
    }

    /// The routed experts of the MoE block for `n` token rows of the residual `x`, routed
    /// already (`ids`, `weights`: moe_route's rows), grouped by expert so that each expert's
    /// weights are read once for all its tokens: the assignments sorted into tiles, the normed
    /// input in fp16 (left in `g.x16` for the shared expert), gate/up and down on tensor cores,
    /// the weighted rows added to `x`. Chunked prefill and large decode batches.
    pub(in crate::backend::cuda) fn routed_experts_grouped(
        &self,
        g: &GroupedExperts,
        layer: &DeviceLayer,
        x: u64,
        n: usize,
        (ids, weights): (u64, u64),
    ) -> Result<()> {
        let (c, s) = (&self.config, &self.stream);
        let m = &g.moe;
        let dims = MoeDims::new(c);
        let post = ptr(&layer.post_norm, s);
        let (order, tiles, tile_count) = (m.order, m.tiles, m.tile_count);
        let (n32, tile) = (n as i32, group_tile(c, n));
        let tile32 = tile as i32;
        // SAFETY: order holds n * top_k entries, tiles max_group_tiles triples (for the narrow
        // tiles, of which there are the most).
        unsafe {
            self.launch(
                "moe_group",
                &self.k.moe_group,
                cfg(1, 1, 1024, 0),
                &mut [
                    arg(&dims),
                    arg(&ids),
                    arg(&n32),
                    arg(&tile32),
                    arg(&order),
                    arg(&tiles),
                    arg(&tile_count),
                ],
            )
        }?;
        // The normed input of every expert, shared included, in fp16.
        let (x16, xs) = (g.x16, g.xscale);
        self.rows_to_half(x, c.hidden_size, Some(post), layer.gate.bits, n, x16, xs)?;
        let (gate_rows, up_rows, down_rows) = (m.gate_rows, m.up_rows, m.down_rows);
        let (act16, actscale) = (m.act16, m.actscale);
        let top_k = c.num_experts_per_tok as i32;
        let tiles_max = max_group_tiles(c, n, tile) as u32;
        let kernel = if tile == GEMM_GROUP_TOKENS_WIDE {
            ("gemm_q_grouped_wide", &self.k.gemm_q_grouped_wide)
        } else {
            ("gemm_q_grouped", &self.k.gemm_q_grouped)
        };
        // One launch for one or two stacked expert matrices with the same rows and inputs (gate
        // and up: grid.z picks the matrix).
        let grouped = |w: [&DeviceWeight; 2],
                       z: u32,
                       rows: usize,
                       x: (u64, u64),
                       in_div: i32,
                       y: [u64; 2]| {
            let (desc, desc2) = (w[0].desc(s), w[1].desc(s));
            let rows32 = rows as i32;
            let mut launch = cfg(
                tiles_max,
                rows.div_ceil(GEMM_ROWS) as u32,
                GEMM_THREADS,
                gemm_smem_bytes(w[0].bits, tile),
            );
            launch.grid_dim.2 = z;
            // SAFETY: tiles and order come from moe_group; y holds a row per assignment.
            unsafe {
                self.launch(
                    kernel.0,
                    kernel.1,
                    launch,
                    &mut [
                        arg(&desc),
                        arg(&desc2),
                        arg(&rows32),
                        arg(&tiles),
                        arg(&tile_count),
                        arg(&order),
                        arg(&in_div),
                        arg(&x.0),
                        arg(&x.1),
                        arg(&y[0]),
                        arg(&y[1]),
                    ],
                )
            }
        };
        let inter = c.moe_intermediate_size;
        grouped(
            [&layer.gate, &layer.up],
            2,
            inter,
            (x16, xs),
            top_k,
            [gate_rows, up_rows],
        )?;
        self.swiglu(
            gate_rows,
            up_rows,
            weights,
            (top_k, top_k + 1, 0),
            (inter, layer.down.bits),
            n * c.num_experts_per_tok,
            act16,
            actscale,
        )?;
        grouped(
            [&layer.down, &layer.down],
            1,
            c.hidden_size,
            (act16, actscale),
            1,
            [down_rows, down_rows],
        )?;
        let hidden32 = c.hidden_size as i32;
        // SAFETY: down_rows holds n * top_k rows of hidden floats, x n rows.
        unsafe {
            self.launch(
                "add_expert_rows",
                &self.k.add_expert_rows,
                cfg(c.hidden_size.div_ceil(256) as u32, n as u32, 256, 0),
                &mut [arg(&down_rows), arg(&top_k), arg(&hidden32), arg(&x)],
            )
        }?;

        Ok(())
    }

    /// act16 = silu(gate) * up * weight per row, in fp16 with a per-row scale, permuted for the
    /// `bits`-bit down projection (swiglu_to_half; `pick` = (per, stride, offset) finds each
    /// row's weight).
    #[allow(clippy::too_many_arguments)]
    fn swiglu(
        &self,
        gate: u64,
        up: u64,
        weights: u64,
        pick: (i32, i32, i32),
        (width, bits): (usize, usize),
        rows: usize,
        act16: u64,
        actscale: u64,
    ) -> Result<()> {
        let (per, stride, offset) = pick;
        let (width, bits, rows32) = (width as i32, bits as i32, rows as i32);
        // SAFETY: gate, up, act16 hold `rows` rows of `width`; weights covers every row's pick.
        unsafe {
            self.launch(
                "swiglu_to_half",
                &self.k.swiglu_to_half,
                cfg(rows.div_ceil(8) as u32, 1, 256, 0),
                &mut [
                    arg(&gate),
                    arg(&up),
                    arg(&weights),
                    arg(&per),
                    arg(&stride),
                    arg(&offset),
                    arg(&width),
                    arg(&bits),
                    arg(&rows32),
                    arg(&act16),
                    arg(&actscale),
                ],
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wide_tiles_once_the_experts_average_a_wide_tile() {
        let c =
            ModelConfig::from_json_str(include_str!("../../../../configs/qwen3.6-35b-a3b.json"))
                .expect("config parses");
        // 256 experts, 8 per token: 4,096 tokens give each expert 128 on average.
        assert_eq!(group_tile(&c, 4096), GEMM_GROUP_TOKENS_WIDE);
        assert_eq!(group_tile(&c, 4095), GEMM_GROUP_TOKENS);
        assert_eq!(group_tile(&c, 1), GEMM_GROUP_TOKENS);
        // The scratch holds the narrow tiles' count, the larger one.
        assert!(max_group_tiles(&c, 4096, GEMM_GROUP_TOKENS) > max_group_tiles(&c, 4096, 128));
    }
}

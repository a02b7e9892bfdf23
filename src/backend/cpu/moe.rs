//! The sparse mixture-of-experts block on the CPU: router softmax and top-k, the selected
//! experts run as matrix products over the rows routed to them, plus the gated shared expert.

use super::ops::{matmul, sigmoid, softmax_in_place, swiglu_in_place};
use crate::config::ModelConfig;
use crate::model::{FeedForward, MoeWeights};

/// The MoE block over `n` rows `x`; returns `[n, hidden]`. Lowers `margins[row]` to the row's
/// routing margin where that is narrower (see `route`).
pub fn forward(
    c: &ModelConfig,
    w: &MoeWeights,
    x: &[f32],
    n: usize,
    margins: &mut [f32],
) -> Vec<f32> {
    let h = c.hidden_size;
    let routes = route(c, w, x, n, margins);

    // Group rows by expert so each expert's weights are read once for all its rows.
    let mut rows_of: Vec<Vec<(usize, f32)>> = vec![Vec::new(); c.num_experts];
    for (row, picks) in routes.iter().enumerate() {
        for &(expert, weight) in picks {
            rows_of[expert].push((row, weight));
        }
    }
    let mut out = vec![0.0f32; n * h];
    for (expert, rows) in rows_of.iter().enumerate() {
        if rows.is_empty() {
            continue;
        }
        let gathered: Vec<f32> = rows
            .iter()
            .flat_map(|&(r, _)| x[r * h..(r + 1) * h].iter().copied())
            .collect();
        let y = feed_forward(&w.experts[expert], &gathered, rows.len());
        for (&(r, weight), yr) in rows.iter().zip(y.chunks_exact(h)) {
            for (o, v) in out[r * h..(r + 1) * h].iter_mut().zip(yr) {
                *o += weight * v;
            }
        }
    }

    let shared = feed_forward(&w.shared_expert, x, n);
    let gates = matmul(x, n, &w.shared_expert_gate);
    for ((o, s), g) in out
        .chunks_exact_mut(h)
        .zip(shared.chunks_exact(h))
        .zip(gates)
    {
        let g = sigmoid(g);
        for (a, b) in o.iter_mut().zip(s) {
            *a += g * b;
        }
    }
    out
}

/// Router: softmax over all experts in f32, the top `k`, renormalised to sum to one. Lowers
/// `margins[row]` to the row's routing margin where that is narrower: the gap between the
/// router logits of the last expert chosen and the first left out, over the row's largest
/// |logit| (infinite where every expert is chosen).
fn route(
    c: &ModelConfig,
    w: &MoeWeights,
    x: &[f32],
    n: usize,
    margins: &mut [f32],
) -> Vec<Vec<(usize, f32)>> {
    let logits = matmul(x, n, &w.router);
    let k = c.num_experts_per_tok;
    logits
        .chunks_exact(c.num_experts)
        .zip(margins.iter_mut())
        .map(|(row, margin)| {
            let mut probs = row.to_vec();
            softmax_in_place(&mut probs);
            let mut order: Vec<usize> = (0..probs.len()).collect();
            // Highest probability first; ties go to the lower expert id.
            order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
            if let (Some(&last), Some(&next)) = (order.get(k - 1), order.get(k)) {
                let largest = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                *margin = margin.min((row[last] - row[next]) / largest);
            }
            order.truncate(k);
            let total: f32 = order.iter().map(|&e| probs[e]).sum();
            order.into_iter().map(|e| (e, probs[e] / total)).collect()
        })
        .collect()
}

/// `down(silu(gate x) · up x)` over `n` rows.
fn feed_forward(f: &FeedForward, x: &[f32], n: usize) -> Vec<f32> {
    let mut gate = matmul(x, n, &f.gate);
    let up = matmul(x, n, &f.up);
    swiglu_in_place(&mut gate, &up);
    matmul(&gate, n, &f.down)
}

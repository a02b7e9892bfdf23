//! Gated full attention on the CPU: q/k RMSNorm per head, partial RoPE, causal GQA softmax
//! attention over the KV cache, output gated by `sigmoid(gate)`.

use rayon::prelude::*;

use super::ops::{dot, matmul, rms_norm_in_place, sigmoid};
use crate::config::ModelConfig;
use crate::model::AttentionWeights;

/// The KV cache of one attention layer of one sequence.
pub struct KvCache<'a> {
    pub keys: &'a mut Vec<f32>,
    pub values: &'a mut Vec<f32>,
}

/// Runs attention for `n` new rows `x` of one sequence whose first new token sits at `start`;
/// appends their keys and values to the cache. Returns `[n, hidden]`.
pub fn forward(
    c: &ModelConfig,
    w: &AttentionWeights,
    x: &[f32],
    n: usize,
    start: usize,
    cache: KvCache<'_>,
) -> Vec<f32> {
    let (heads, kv_heads, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let q_and_gate = matmul(x, n, &w.q_proj);
    let mut k = matmul(x, n, &w.k_proj);
    let v = matmul(x, n, &w.v_proj);

    // Split each head's projection into query and gate.
    let mut q = vec![0.0f32; n * heads * hd];
    let mut gate = vec![0.0f32; n * heads * hd];
    for (row, src) in q_and_gate.chunks_exact(2 * hd).enumerate() {
        q[row * hd..(row + 1) * hd].copy_from_slice(&src[..hd]);
        gate[row * hd..(row + 1) * hd].copy_from_slice(&src[hd..]);
    }
    rms_norm_in_place(&mut q, &w.q_norm, c.rms_norm_eps);
    rms_norm_in_place(&mut k, &w.k_norm, c.rms_norm_eps);
    let rope = Rope::new(c);
    for t in 0..n {
        let pos = start + t;
        for head in q[t * heads * hd..(t + 1) * heads * hd].chunks_exact_mut(hd) {
            rope.apply(head, pos);
        }
        for head in k[t * kv_heads * hd..(t + 1) * kv_heads * hd].chunks_exact_mut(hd) {
            rope.apply(head, pos);
        }
    }
    cache.keys.extend_from_slice(&k);
    cache.values.extend_from_slice(&v);
    let (keys, values) = (&cache.keys[..], &cache.values[..]);

    // One task per (row, head): scores over every cached position up to the row's own.
    let group = heads / kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let kv_stride = kv_heads * hd;
    let mut out = vec![0.0f32; n * heads * hd];
    out.par_chunks_mut(hd).enumerate().for_each(|(i, o)| {
        let (t, head) = (i / heads, i % heads);
        let kvh = head / group;
        let qv = &q[i * hd..(i + 1) * hd];
        let len = start + t + 1;
        let mut scores: Vec<f32> = (0..len)
            .map(|p| dot(qv, &keys[p * kv_stride + kvh * hd..][..hd]) * scale)
            .collect();
        super::ops::softmax_in_place(&mut scores);
        for (p, s) in scores.iter().enumerate() {
            let vrow = &values[p * kv_stride + kvh * hd..][..hd];
            for (a, b) in o.iter_mut().zip(vrow) {
                *a += s * b;
            }
        }
    });
    for (o, g) in out.iter_mut().zip(&gate) {
        *o *= sigmoid(*g);
    }
    matmul(&out, n, &w.o_proj)
}

/// Rotary position embedding over the first `rotary_dim` dimensions of a head (rotate-half form).
struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    fn new(c: &ModelConfig) -> Self {
        let dim = c.rotary_dim;
        let inv_freq = (0..dim / 2)
            .map(|i| (1.0 / c.rope_theta.powf((2 * i) as f64 / dim as f64)) as f32)
            .collect();
        Self { inv_freq }
    }

    fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.inv_freq.len();
        for (i, &f) in self.inv_freq.iter().enumerate() {
            // The reference forms the angle in f32; doing the same keeps long positions identical.
            let angle = (pos as f32 * f) as f64;
            let (sin, cos) = (angle.sin() as f32, angle.cos() as f32);
            let (a, b) = (x[i], x[i + half]);
            x[i] = a * cos - b * sin;
            x[i + half] = b * cos + a * sin;
        }
    }
}

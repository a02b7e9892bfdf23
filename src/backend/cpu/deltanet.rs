//! Gated DeltaNet on the CPU.
//!
//! Both paths share the projections, the causal depthwise convolution, the gates and the gated
//! RMSNorm; they differ in how the delta rule runs: prefill uses the chunkwise form (intra-chunk
//! work as small matrix products, state carried across chunks), decode the recurrent form, one
//! token at a time. Per value head `h` (key head `h / (value_heads / key_heads)`):
//!
//! ```text
//! S ← S·exp(g_t);  S ← S + k_t ⊗ β_t (v_t − Sᵀk_t);  o_t = Sᵀ q_t
//! ```
//! with `q, k` L2-normalised, `q` scaled by `1/√d_k`, `β = sigmoid(b)`,
//! `g = −exp(A_log)·softplus(a + dt_bias)`.

use rayon::prelude::*;

use super::ops::{dot, l2_normalize, matmul, sigmoid, silu, softplus};
use crate::config::ModelConfig;
use crate::model::DeltaNetWeights;

/// Tokens per chunk of the chunkwise delta rule (the reference's chunk size).
const CHUNK: usize = 64;

/// The DeltaNet state of one layer of one sequence.
pub struct DeltaNetState<'a> {
    /// `[kernel - 1, conv_dim]`, oldest first.
    pub conv: &'a mut [f32],
    /// `[value_heads, key_head_dim, value_head_dim]`.
    pub recurrent: &'a mut [f32],
}

/// Prefill: `n` rows of one sequence. Returns `[n, hidden]`.
pub fn prefill(
    c: &ModelConfig,
    w: &DeltaNetWeights,
    x: &[f32],
    n: usize,
    state: DeltaNetState<'_>,
) -> Vec<f32> {
    let p = Projections::new(w, x, n);
    let mixed = causal_conv(c, w, state.conv, &p.qkv);
    let inputs = HeadInputs::new(c, w, &mixed, &p.b, &p.a, n);
    let core = chunked_delta_rule(c, &inputs, state.recurrent, n);
    output(c, w, core, &p.z, n)
}

/// Decode: one new row per sequence, `x` is `[states.len(), hidden]`. Returns the same shape.
pub fn decode(
    c: &ModelConfig,
    w: &DeltaNetWeights,
    x: &[f32],
    states: &mut [DeltaNetState<'_>],
) -> Vec<f32> {
    let n = states.len();
    let p = Projections::new(w, x, n);
    let (cd, hv) = (c.linear_conv_dim(), c.linear_num_value_heads);
    let mut core = Vec::with_capacity(n * c.linear_value_dim());
    for (row, state) in states.iter_mut().enumerate() {
        let mixed = causal_conv(c, w, state.conv, &p.qkv[row * cd..(row + 1) * cd]);
        let b = &p.b[row * hv..(row + 1) * hv];
        let a = &p.a[row * hv..(row + 1) * hv];
        let inputs = HeadInputs::new(c, w, &mixed, b, a, 1);
        core.extend(recurrent_step(c, &inputs, state.recurrent));
    }
    output(c, w, core, &p.z, n)
}

/// The four input projections of `n` rows.
struct Projections {
    qkv: Vec<f32>,
    z: Vec<f32>,
    b: Vec<f32>,
    a: Vec<f32>,
}

impl Projections {
    fn new(w: &DeltaNetWeights, x: &[f32], n: usize) -> Self {
        Self {
            qkv: matmul(x, n, &w.in_proj_qkv),
            z: matmul(x, n, &w.in_proj_z),
            b: matmul(x, n, &w.in_proj_b),
            a: matmul(x, n, &w.in_proj_a),
        }
    }
}

/// Depthwise causal convolution over `qkv` rows (continuing from `conv_state`), then SiLU.
/// Updates `conv_state` to the last `kernel - 1` inputs.
fn causal_conv(
    c: &ModelConfig,
    w: &DeltaNetWeights,
    conv_state: &mut [f32],
    qkv: &[f32],
) -> Vec<f32> {
    let (cd, kern) = (c.linear_conv_dim(), c.linear_conv_kernel_dim);
    let n = qkv.len() / cd;
    let history = kern - 1;
    let mut full = Vec::with_capacity((history + n) * cd);
    full.extend_from_slice(conv_state);
    full.extend_from_slice(qkv);
    let mut out = vec![0.0f32; n * cd];
    for t in 0..n {
        for ch in 0..cd {
            let taps = &w.conv1d[ch * kern..(ch + 1) * kern];
            let acc: f32 = (0..kern).map(|j| taps[j] * full[(t + j) * cd + ch]).sum();
            out[t * cd + ch] = silu(acc);
        }
    }
    conv_state.copy_from_slice(&full[n * cd..]);
    out
}

/// Per-head delta-rule inputs, laid out head-major so each head's work is contiguous.
struct HeadInputs {
    /// `[key_heads, n, key_head_dim]`, L2-normalised and scaled by `1/√d_k`.
    q: Vec<f32>,
    /// `[key_heads, n, key_head_dim]`, L2-normalised.
    k: Vec<f32>,
    /// `[value_heads, n, value_head_dim]`.
    v: Vec<f32>,
    /// `[value_heads, n]`: write strength `β` and log-decay `g`.
    beta: Vec<f32>,
    g: Vec<f32>,
}

impl HeadInputs {
    fn new(
        c: &ModelConfig,
        w: &DeltaNetWeights,
        mixed: &[f32],
        b: &[f32],
        a: &[f32],
        n: usize,
    ) -> Self {
        let (hk, dk, hv, dv) = (
            c.linear_num_key_heads,
            c.linear_key_head_dim,
            c.linear_num_value_heads,
            c.linear_value_head_dim,
        );
        let (kd, cd) = (c.linear_key_dim(), c.linear_conv_dim());
        let scale = 1.0 / (dk as f32).sqrt();
        let mut q = vec![0.0f32; hk * n * dk];
        let mut k = vec![0.0f32; hk * n * dk];
        let mut v = vec![0.0f32; hv * n * dv];
        for t in 0..n {
            let row = &mixed[t * cd..(t + 1) * cd];
            for h in 0..hk {
                let qd = &mut q[(h * n + t) * dk..][..dk];
                qd.copy_from_slice(&row[h * dk..][..dk]);
                l2_normalize(qd, 1e-6);
                qd.iter_mut().for_each(|x| *x *= scale);
                let kd_ = &mut k[(h * n + t) * dk..][..dk];
                kd_.copy_from_slice(&row[kd + h * dk..][..dk]);
                l2_normalize(kd_, 1e-6);
            }
            for h in 0..hv {
                v[(h * n + t) * dv..][..dv].copy_from_slice(&row[2 * kd + h * dv..][..dv]);
            }
        }
        let mut beta = vec![0.0f32; hv * n];
        let mut g = vec![0.0f32; hv * n];
        for t in 0..n {
            for h in 0..hv {
                beta[h * n + t] = sigmoid(b[t * hv + h]);
                g[h * n + t] = -w.a_log[h].exp() * softplus(a[t * hv + h] + w.dt_bias[h]);
            }
        }
        Self { q, k, v, beta, g }
    }
}

/// One decode step of the recurrent form for every value head; returns `[value_heads, d_v]`.
fn recurrent_step(c: &ModelConfig, x: &HeadInputs, recurrent: &mut [f32]) -> Vec<f32> {
    let (dk, hv, dv) = (
        c.linear_key_head_dim,
        c.linear_num_value_heads,
        c.linear_value_head_dim,
    );
    let group = hv / c.linear_num_key_heads;
    let mut out = vec![0.0f32; hv * dv];
    out.par_chunks_mut(dv)
        .zip(recurrent.par_chunks_mut(dk * dv))
        .enumerate()
        .for_each(|(h, (o, s))| {
            let (q, k) = (
                &x.q[(h / group) * dk..][..dk],
                &x.k[(h / group) * dk..][..dk],
            );
            let v = &x.v[h * dv..][..dv];
            let decay = x.g[h].exp();
            s.iter_mut().for_each(|e| *e *= decay);
            // delta = β (v − Sᵀk)
            let mut delta = v.to_vec();
            for (i, row) in s.chunks_exact(dv).enumerate() {
                for (d, r) in delta.iter_mut().zip(row) {
                    *d -= k[i] * r;
                }
            }
            delta.iter_mut().for_each(|d| *d *= x.beta[h]);
            for (i, row) in s.chunks_exact_mut(dv).enumerate() {
                for (r, d) in row.iter_mut().zip(&delta) {
                    *r += k[i] * d;
                }
                for (oo, r) in o.iter_mut().zip(row.iter()) {
                    *oo += q[i] * r;
                }
            }
        });
    out
}

/// The chunkwise delta rule over `n` tokens for every value head; returns `[n, value_heads, d_v]`.
///
/// Within a chunk, with `c_i` the cumulative log-decay and `L` the unit lower-triangular matrix
/// `L_ij = (β_i k_i · k_j)·exp(c_i − c_j)` for `j < i`, the delta rule's sequential updates become
/// `U = L⁻¹(β V)` and `W = L⁻¹(β K ∘ exp(c))` (forward substitution), then
/// `V' = U − W S`, `O = (Q ∘ exp(c)) S + (QKᵀ ∘ decay, causal) V'` and
/// `S ← exp(c_last) S + (K ∘ exp(c_last − c))ᵀ V'`.
fn chunked_delta_rule(
    c: &ModelConfig,
    x: &HeadInputs,
    recurrent: &mut [f32],
    n: usize,
) -> Vec<f32> {
    let (dk, hv, dv) = (
        c.linear_key_head_dim,
        c.linear_num_value_heads,
        c.linear_value_head_dim,
    );
    let group = hv / c.linear_num_key_heads;
    let mut head_out = vec![0.0f32; hv * n * dv];
    head_out
        .par_chunks_mut(n * dv)
        .zip(recurrent.par_chunks_mut(dk * dv))
        .enumerate()
        .for_each(|(h, (out, s))| {
            let kh = h / group;
            let q = &x.q[kh * n * dk..][..n * dk];
            let k = &x.k[kh * n * dk..][..n * dk];
            let v = &x.v[h * n * dv..][..n * dv];
            let beta = &x.beta[h * n..][..n];
            let g = &x.g[h * n..][..n];
            for start in (0..n).step_by(CHUNK) {
                let len = CHUNK.min(n - start);
                let rows = start..start + len;
                delta_rule_chunk(
                    &q[rows.start * dk..rows.end * dk],
                    &k[rows.start * dk..rows.end * dk],
                    &v[rows.start * dv..rows.end * dv],
                    &beta[rows.clone()],
                    &g[rows.clone()],
                    s,
                    &mut out[rows.start * dv..rows.end * dv],
                    dk,
                    dv,
                );
            }
        });
    // Head-major to token-major.
    let mut core = vec![0.0f32; n * hv * dv];
    for h in 0..hv {
        for t in 0..n {
            core[(t * hv + h) * dv..][..dv].copy_from_slice(&head_out[(h * n + t) * dv..][..dv]);
        }
    }
    core
}

/// One chunk of one head: reads and updates `s` (`[d_k, d_v]`), writes `out` (`[len, d_v]`).
#[allow(clippy::too_many_arguments)]
fn delta_rule_chunk(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    beta: &[f32],
    g: &[f32],
    s: &mut [f32],
    out: &mut [f32],
    dk: usize,
    dv: usize,
) {
    let len = beta.len();
    let mut cum = vec![0.0f32; len];
    let mut acc = 0.0f32;
    for (c, &gi) in cum.iter_mut().zip(g) {
        acc += gi;
        *c = acc;
    }
    let key = |i: usize| &k[i * dk..(i + 1) * dk];
    let query = |i: usize| &q[i * dk..(i + 1) * dk];

    // Forward substitution: U_i = β_i v_i − Σ_{j<i} L_ij U_j, W_i likewise from β_i k_i exp(c_i).
    let mut u = vec![0.0f32; len * dv];
    let mut wk = vec![0.0f32; len * dk];
    for i in 0..len {
        let (done_u, rest_u) = u.split_at_mut(i * dv);
        let (done_w, rest_w) = wk.split_at_mut(i * dk);
        let ui = &mut rest_u[..dv];
        let wi = &mut rest_w[..dk];
        for (o, vv) in ui.iter_mut().zip(&v[i * dv..(i + 1) * dv]) {
            *o = vv * beta[i];
        }
        let e = cum[i].exp();
        for (o, kk) in wi.iter_mut().zip(key(i)) {
            *o = kk * beta[i] * e;
        }
        for j in 0..i {
            let l = beta[i] * dot(key(i), key(j)) * (cum[i] - cum[j]).exp();
            for (o, x) in ui.iter_mut().zip(&done_u[j * dv..(j + 1) * dv]) {
                *o -= l * x;
            }
            for (o, x) in wi.iter_mut().zip(&done_w[j * dk..(j + 1) * dk]) {
                *o -= l * x;
            }
        }
    }

    // V' = U − W S.
    let mut v_new = u;
    for i in 0..len {
        let row = &mut v_new[i * dv..(i + 1) * dv];
        for (d, srow) in s.chunks_exact(dv).enumerate() {
            let wid = wk[i * dk + d];
            for (o, sv) in row.iter_mut().zip(srow) {
                *o -= wid * sv;
            }
        }
    }

    // O_i = exp(c_i) Sᵀq_i + Σ_{j≤i} (q_i·k_j) exp(c_i − c_j) V'_j.
    for i in 0..len {
        let o = &mut out[i * dv..(i + 1) * dv];
        let e = cum[i].exp();
        for (d, srow) in s.chunks_exact(dv).enumerate() {
            let qd = query(i)[d] * e;
            for (a, sv) in o.iter_mut().zip(srow) {
                *a += qd * sv;
            }
        }
        for j in 0..=i {
            let a = dot(query(i), key(j)) * (cum[i] - cum[j]).exp();
            for (x, y) in o.iter_mut().zip(&v_new[j * dv..(j + 1) * dv]) {
                *x += a * y;
            }
        }
    }

    // S ← exp(c_last) S + Σ_j exp(c_last − c_j) k_j ⊗ V'_j.
    let last = cum[len - 1];
    let decay = last.exp();
    s.iter_mut().for_each(|x| *x *= decay);
    for j in 0..len {
        let f = (last - cum[j]).exp();
        let vj = &v_new[j * dv..(j + 1) * dv];
        for (d, srow) in s.chunks_exact_mut(dv).enumerate() {
            let kd = key(j)[d] * f;
            for (a, b) in srow.iter_mut().zip(vj) {
                *a += kd * b;
            }
        }
    }
}

/// Gated RMSNorm per value head (`norm(o) · w · silu(z)`), then the output projection.
fn output(
    c: &ModelConfig,
    w: &DeltaNetWeights,
    mut core: Vec<f32>,
    z: &[f32],
    n: usize,
) -> Vec<f32> {
    let dv = c.linear_value_head_dim;
    for (o, zz) in core.chunks_exact_mut(dv).zip(z.chunks_exact(dv)) {
        let mean_sq = o.iter().map(|v| v * v).sum::<f32>() / dv as f32;
        let inv = 1.0 / (mean_sq + c.rms_norm_eps).sqrt();
        for ((x, nw), zv) in o.iter_mut().zip(&w.norm).zip(zz) {
            *x = *x * inv * nw * silu(*zv);
        }
    }
    matmul(&core, n, &w.out_proj)
}

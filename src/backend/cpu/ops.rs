//! Small f32 tensor operations of the CPU backend: matrix products against stored weights,
//! norms and activations. Rows are token positions; everything is row-major.

use rayon::prelude::*;

use crate::model::Matrix;

/// Weight rows converted or dequantised to f32 at a time by one task: enough to amortise the conversion over
/// all input rows, small enough to stay in cache.
const ROW_BLOCK: usize = 16;

/// `y[n, m] = x[n, k] · W[m, k]ᵀ`, converting (or dequantising) the weight to f32 a block of rows
/// at a time, so a quantised model is never expanded whole.
pub fn matmul(x: &[f32], n: usize, w: &Matrix) -> Vec<f32> {
    let (m, k) = (w.rows, w.cols);
    debug_assert_eq!(x.len(), n * k);
    // Each task owns a block of output columns; computing yᵀ keeps those writes contiguous.
    let mut yt = vec![0.0f32; m * n];
    yt.par_chunks_mut(ROW_BLOCK * n)
        .enumerate()
        .for_each(|(block, out)| {
            let first = block * ROW_BLOCK;
            let rows = out.len() / n;
            let mut wf = vec![0.0f32; rows * k];
            w.rows_to_f32(first, &mut wf);
            for (r, w_row) in wf.chunks_exact(k).enumerate() {
                for (i, x_row) in x.chunks_exact(k).enumerate() {
                    out[r * n + i] = dot(w_row, x_row);
                }
            }
        });
    if n == 1 {
        return yt;
    }
    let mut y = vec![0.0f32; n * m];
    for (j, col) in yt.chunks_exact(n).enumerate() {
        for (i, &v) in col.iter().enumerate() {
            y[i * m + j] = v;
        }
    }
    y
}

/// Dot product with independent partial sums, so the compiler can vectorise it.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0.0f32; LANES];
    let (ac, bc) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// RMSNorm of every row of `x` (width `scale.len()`), multiplied by `scale`.
pub fn rms_norm(x: &[f32], scale: &[f32], eps: f32) -> Vec<f32> {
    let mut out = x.to_vec();
    rms_norm_in_place(&mut out, scale, eps);
    out
}

/// RMSNorm of every row of `x` in place.
pub fn rms_norm_in_place(x: &mut [f32], scale: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(scale.len()) {
        let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for (v, s) in row.iter_mut().zip(scale) {
            *v = *v * inv * s;
        }
    }
}

/// Scales `x` to unit L2 norm, as the reference does: `x / sqrt(sum(x²) + eps)`.
pub fn l2_normalize(x: &mut [f32], eps: f32) {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `log(1 + e^x)`, linear above 20 as torch's softplus is.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// `silu(gate) * up`, element-wise into `gate`.
pub fn swiglu_in_place(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// Numerically stable softmax in place.
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    x.iter_mut().for_each(|v| *v /= sum);
}

/// `y += x` element-wise.
pub fn add_in_place(y: &mut [f32], x: &[f32]) {
    for (a, b) in y.iter_mut().zip(x) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_naive_sum() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..37).map(|i| 1.0 - i as f32 * 0.1).collect();
        let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - naive).abs() < 1e-3);
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = vec![1.0, 2.0, 3.0, 1000.0];
        softmax_in_place(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[3] > 0.99);
    }
}

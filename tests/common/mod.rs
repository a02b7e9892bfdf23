//! Helpers shared by the integration tests that compare logits.

/// Largest absolute difference, relative to the largest reference magnitude.
pub fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    let diff = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    diff / want.iter().map(|v| v.abs()).fold(0.0, f32::max)
}

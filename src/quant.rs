//! MLX affine quantisation: the settings a matrix is quantised with (from `config.json`'s
//! `quantization` block), the quantise/dequantise math, and MLX's bit packing.
//!
//! A row of `cols` inputs is cut into groups of `group_size` consecutive values. Each group has a
//! scale `s` and a bias `b` and stores unsigned `bits`-bit integers `q`, standing for `s·q + b`.
//! The integers are packed `32 / bits` to a little-endian uint32 word, the first in the lowest
//! bits. Quantisation follows MLX's `quantize` exactly (same rounding, same choice of scale), so a
//! checkpoint lily converts holds the same bytes as one MLX-LM converts.

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Map, Value};

/// Bits per value and group size of one quantised matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantSpec {
    pub bits: u32,
    pub group_size: usize,
}

impl QuantSpec {
    pub const SUPPORTED_BITS: [u32; 2] = [4, 8];
    pub const SUPPORTED_GROUP_SIZES: [usize; 3] = [32, 64, 128];

    /// What MLX uses for a field a `quantization` entry leaves out (its affine defaults).
    const MLX_DEFAULT: QuantSpec = QuantSpec {
        bits: 4,
        group_size: 64,
    };

    /// A supported setting; anything else is an error naming the value.
    pub fn new(bits: u32, group_size: usize) -> Result<Self> {
        ensure!(
            Self::SUPPORTED_BITS.contains(&bits),
            "{bits}-bit quantisation is not supported (lily reads 4 or 8 bits)"
        );
        ensure!(
            Self::SUPPORTED_GROUP_SIZES.contains(&group_size),
            "group size {group_size} is not supported (lily reads 32, 64 or 128)"
        );
        Ok(Self { bits, group_size })
    }

    /// Integers packed into one uint32 word.
    pub fn values_per_word(self) -> usize {
        32 / self.bits as usize
    }

    /// Words holding one row of `cols` values.
    pub fn words_per_row(self, cols: usize) -> usize {
        cols / self.values_per_word()
    }

    /// Groups (scales, biases) of one row of `cols` values.
    pub fn groups_per_row(self, cols: usize) -> usize {
        cols / self.group_size
    }

    /// Whether rows of `cols` values split into whole groups (and so whole words).
    pub fn fits(self, cols: usize) -> bool {
        cols.is_multiple_of(self.group_size)
    }

    /// The largest integer a value can take.
    fn max_level(self) -> u32 {
        (1 << self.bits) - 1
    }
}

/// How a checkpoint's matrices are quantised: MLX-LM's `quantization` block, a global setting
/// plus per-module overrides keyed by module path (e.g. `language_model.model.layers.0.mlp.gate`).
#[derive(Clone, Debug, PartialEq)]
pub struct Quantization {
    pub default: QuantSpec,
    overrides: Vec<(String, Option<QuantSpec>)>,
}

impl Quantization {
    /// Reads `quantization` (or, as MLX-LM also accepts, `quantization_config`, at the top level or
    /// in `text_config`) from a parsed `config.json`. `None` when the checkpoint is not quantised.
    pub fn from_config(root: &Value) -> Result<Option<Self>> {
        let text = root.get("text_config");
        let found = [
            ("quantization", root.get("quantization")),
            ("quantization_config", root.get("quantization_config")),
            (
                "text_config.quantization_config",
                text.and_then(|t| t.get("quantization_config")),
            ),
        ]
        .into_iter()
        .find_map(|(field, v)| v.filter(|v| !v.is_null()).map(|v| (field, v)));
        let Some((field, block)) = found else {
            return Ok(None);
        };
        let block = block
            .as_object()
            .with_context(|| format!("field `{field}` is not an object"))?;
        if let Some(method) = block.get("quant_method") {
            bail!(
                "field `{field}.quant_method` is {method}: lily reads MLX affine quantisation only \
                 (a `quantization` block with `bits`, `group_size` and `mode: \"affine\"`)"
            );
        }
        let default = parse_entry(field, block, QuantSpec::MLX_DEFAULT)?;
        let mut overrides = Vec::new();
        for (key, value) in block {
            let spec = match value {
                Value::Object(entry) => Some(parse_entry(
                    &format!("{field}.\"{key}\""),
                    entry,
                    QuantSpec::MLX_DEFAULT,
                )?),
                Value::Bool(true) => Some(default),
                Value::Bool(false) => None,
                _ => continue,
            };
            overrides.push((key.clone(), spec));
        }
        Ok(Some(Self { default, overrides }))
    }

    /// A checkpoint quantised with `default` everywhere except `overrides`.
    pub fn new(default: QuantSpec, overrides: Vec<(String, QuantSpec)>) -> Self {
        Self {
            default,
            overrides: overrides
                .into_iter()
                .map(|(path, spec)| (path, Some(spec)))
                .collect(),
        }
    }

    /// The override `config.json` gives for the module at `path`: `Some(None)` when it says the
    /// module stays unquantised, `None` when it says nothing.
    pub fn override_for(&self, path: &str) -> Option<Option<QuantSpec>> {
        self.overrides
            .iter()
            .find(|(p, _)| p == path)
            .map(|(_, spec)| *spec)
    }

    /// The block as MLX-LM writes it: `group_size`, `bits`, `mode`, then the overrides.
    pub fn to_json(&self) -> Value {
        let mut block = Map::new();
        block.insert("group_size".into(), self.default.group_size.into());
        block.insert("bits".into(), self.default.bits.into());
        block.insert("mode".into(), "affine".into());
        for (path, spec) in &self.overrides {
            let entry = match spec {
                Some(s) => serde_json::json!({"group_size": s.group_size, "bits": s.bits}),
                None => Value::Bool(false),
            };
            block.insert(path.clone(), entry);
        }
        Value::Object(block)
    }
}

/// One `{group_size, bits, mode}` entry; absent fields take `fallback`'s values.
fn parse_entry(field: &str, entry: &Map<String, Value>, fallback: QuantSpec) -> Result<QuantSpec> {
    if let Some(mode) = entry.get("mode").filter(|m| !m.is_null()) {
        ensure!(
            mode.as_str() == Some("affine"),
            "field `{field}.mode` is {mode}: lily reads only \"affine\" quantisation"
        );
    }
    let number = |key: &str, fallback: usize| -> Result<usize> {
        match entry.get(key).filter(|v| !v.is_null()) {
            None => Ok(fallback),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .with_context(|| format!("field `{field}.{key}` is {v}, not a whole number")),
        }
    };
    let bits = number("bits", fallback.bits as usize)?;
    let group_size = number("group_size", fallback.group_size)?;
    ensure!(
        QuantSpec::SUPPORTED_BITS
            .iter()
            .any(|&b| b as usize == bits),
        "field `{field}.bits` is {bits}: lily reads 4- or 8-bit quantisation"
    );
    ensure!(
        QuantSpec::SUPPORTED_GROUP_SIZES.contains(&group_size),
        "field `{field}.group_size` is {group_size}: lily reads group sizes 32, 64 or 128"
    );
    Ok(QuantSpec {
        bits: bits as u32,
        group_size,
    })
}

/// Quantises one row (`row.len()` a multiple of the group size) as MLX does, writing its packed
/// words and per-group scales and biases. Scales and biases come out in f32; the integers were
/// rounded against these f32 values, whatever dtype they are stored in afterwards.
pub fn quantize_row(
    spec: QuantSpec,
    row: &[f32],
    words: &mut [u32],
    scales: &mut [f32],
    biases: &mut [f32],
) {
    let levels = spec.max_level() as f32;
    let per_word = spec.values_per_word();
    let words_per_group = spec.group_size / per_word;
    for (((group, group_words), scale_out), bias_out) in row
        .chunks_exact(spec.group_size)
        .zip(words.chunks_exact_mut(words_per_group))
        .zip(scales.iter_mut())
        .zip(biases.iter_mut())
    {
        let (min, max) = group
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                (lo.min(v), hi.max(v))
            });
        // The extreme of larger magnitude is represented exactly (as the bias, at integer 0):
        // the scale's sign makes the integers count away from it.
        let toward_max = min.abs() > max.abs();
        let step = ((max - min) / levels).max(1e-7);
        let mut scale = if toward_max { step } else { -step };
        let edge = if toward_max { min } else { max };
        let edge_steps = (edge / scale).round_ties_even();
        let mut bias = 0.0;
        if edge_steps != 0.0 {
            scale = edge / edge_steps;
            bias = edge;
        }
        for (word, values) in group_words.iter_mut().zip(group.chunks_exact(per_word)) {
            *word = values.iter().enumerate().fold(0u32, |acc, (k, &v)| {
                let q = ((v - bias) / scale).round_ties_even().clamp(0.0, levels);
                acc | (q as u32) << (k as u32 * spec.bits)
            });
        }
        *scale_out = scale;
        *bias_out = bias;
    }
}

/// Dequantises one row: `words` holds the row's packed little-endian uint32 words, `scales` and
/// `biases` its per-group values; `out.len()` is the row's width.
pub fn dequantize_row(
    spec: QuantSpec,
    words: &[u8],
    scales: &[f32],
    biases: &[f32],
    out: &mut [f32],
) {
    let per_word = spec.values_per_word();
    let mask = spec.max_level();
    let group_bytes = spec.group_size / per_word * 4;
    for (((group_out, group_words), &scale), &bias) in out
        .chunks_exact_mut(spec.group_size)
        .zip(words.chunks_exact(group_bytes))
        .zip(scales)
        .zip(biases)
    {
        for (values, word) in group_out
            .chunks_exact_mut(per_word)
            .zip(group_words.chunks_exact(4))
        {
            let word = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
            for (k, v) in values.iter_mut().enumerate() {
                let q = (word >> (k as u32 * spec.bits)) & mask;
                *v = scale * q as f32 + bias;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(bits: u32, group_size: usize) -> QuantSpec {
        QuantSpec::new(bits, group_size).unwrap()
    }

    /// A deterministic, uneven test row.
    fn row(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8;
                (x as f32 / (1 << 24) as f32 - 0.4) * 0.3
            })
            .collect()
    }

    fn round_trip(s: QuantSpec, values: &[f32]) -> Vec<f32> {
        let cols = values.len();
        let mut words = vec![0u32; s.words_per_row(cols)];
        let mut scales = vec![0.0; s.groups_per_row(cols)];
        let mut biases = vec![0.0; s.groups_per_row(cols)];
        quantize_row(s, values, &mut words, &mut scales, &mut biases);
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let mut out = vec![0.0; cols];
        dequantize_row(s, &bytes, &scales, &biases, &mut out);
        out
    }

    #[test]
    fn round_trip_error_is_within_half_a_step() {
        for bits in [4, 8] {
            for group in [32, 64, 128] {
                let s = spec(bits, group);
                let values = row(512, bits * 7 + group as u32);
                let back = round_trip(s, &values);
                for (g, (orig, deq)) in values
                    .chunks_exact(group)
                    .zip(back.chunks_exact(group))
                    .enumerate()
                {
                    let (lo, hi) = orig
                        .iter()
                        .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
                    let step = (hi - lo) / ((1 << bits) - 1) as f32;
                    let worst = orig
                        .iter()
                        .zip(deq)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0, f32::max);
                    // Rounding costs half a step; refitting the scale so the larger extreme is
                    // exact can leave the other extreme short by up to levels / (levels - 1)
                    // steps (then clamped).
                    assert!(
                        worst <= step * 1.1 + 1e-7,
                        "{bits}-bit g{group}, group {g}: error {worst} vs step {step}"
                    );
                }
            }
        }
    }

    #[test]
    fn extreme_of_larger_magnitude_is_exact() {
        let mut values = row(64, 3);
        values[17] = -1.0;
        let back = round_trip(spec(4, 64), &values);
        assert_eq!(back[17], -1.0);
        values[17] = 2.0;
        let back = round_trip(spec(4, 64), &values);
        assert_eq!(back[17], 2.0);
    }

    #[test]
    fn constant_group_survives() {
        for v in [0.0, 0.75, -3.0] {
            let back = round_trip(spec(4, 32), &[v; 32]);
            assert!(back.iter().all(|&b| (b - v).abs() < 1e-6), "{v}: {back:?}");
        }
    }

    #[test]
    fn packing_puts_the_first_value_in_the_low_bits() {
        // One 4-bit group of 32 holding 0..15 twice.
        let s = spec(4, 32);
        let values: Vec<f32> = (0..32).map(|i| (i % 16) as f32).collect();
        let mut words = vec![0u32; 4];
        let (mut scales, mut biases) = (vec![0.0; 1], vec![0.0; 1]);
        quantize_row(s, &values, &mut words, &mut scales, &mut biases);
        // max 15 has the larger magnitude: it is the bias, and the scale is -1.
        assert_eq!((scales[0], biases[0]), (-1.0, 15.0));
        // q = 15 - v: 15, 14, ..., 8 in the first word, lowest nibble first.
        assert_eq!(words[0], 0x89ab_cdef);
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let mut out = vec![0.0; 32];
        dequantize_row(s, &bytes, &scales, &biases, &mut out);
        assert_eq!(out, values);

        // 8 bits: four values per word, first in the lowest byte. With -255 the minimum, the
        // scale is 1 and the bias -255.
        let s = spec(8, 32);
        let mut values: Vec<f32> = (0..32).map(|i| -(i as f32)).collect();
        values[31] = -255.0;
        let mut words = vec![0u32; 8];
        quantize_row(s, &values, &mut words, &mut scales, &mut biases);
        assert_eq!((scales[0], biases[0]), (1.0, -255.0));
        // q = v + 255: 255, 254, 253, 252 in the first word, lowest byte first.
        assert_eq!(words[0], u32::from_le_bytes([255, 254, 253, 252]));
    }

    #[test]
    fn unsupported_settings_name_the_field() {
        let err = |v: Value| format!("{:#}", Quantization::from_config(&v).unwrap_err());
        let e = err(serde_json::json!({"quantization": {"bits": 3, "group_size": 64}}));
        assert!(e.contains("quantization.bits") && e.contains('3'), "{e}");
        let e = err(serde_json::json!({"quantization": {"bits": 4, "group_size": 16}}));
        assert!(
            e.contains("quantization.group_size") && e.contains("16"),
            "{e}"
        );
        let e = err(serde_json::json!({"quantization": {"bits": 4, "mode": "mxfp4"}}));
        assert!(
            e.contains("quantization.mode") && e.contains("mxfp4"),
            "{e}"
        );
        let e = err(serde_json::json!({"quantization": {
            "bits": 4, "group_size": 64, "language_model.lm_head": {"bits": 5, "group_size": 64}
        }}));
        assert!(
            e.contains("language_model.lm_head") && e.contains("bits"),
            "{e}"
        );
        let e = err(serde_json::json!({"quantization_config": {"quant_method": "awq"}}));
        assert!(e.contains("quant_method") && e.contains("awq"), "{e}");
    }

    #[test]
    fn config_block_with_overrides() {
        let q = Quantization::from_config(&serde_json::json!({
            "quantization": {"group_size": 32, "bits": 8, "mode": "affine",
                "a.mlp.gate": {"group_size": 64, "bits": 4},
                "a.lm_head": false}
        }))
        .unwrap()
        .unwrap();
        assert_eq!(q.default, spec(8, 32));
        assert_eq!(q.override_for("a.mlp.gate"), Some(Some(spec(4, 64))));
        assert_eq!(q.override_for("a.lm_head"), Some(None));
        assert_eq!(q.override_for("a.other"), None);
        // `quantization_config` alone, and defaults for absent fields.
        let q = Quantization::from_config(&serde_json::json!({"quantization_config": {}}))
            .unwrap()
            .unwrap();
        assert_eq!(q.default, spec(4, 64));
        assert!(
            Quantization::from_config(&serde_json::json!({}))
                .unwrap()
                .is_none()
        );
    }
}

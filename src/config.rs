//! Model configuration: `config.json` parsed into the hyper-parameters and layer plan.
//!
//! Both forms of the file are accepted: the multimodal wrapper (`model_type: qwen3_5_moe` with the
//! text model under `text_config`) and the text-only export (`model_type: qwen3_5_moe_text`), with
//! MLX-LM's `quantization` block when the checkpoint is quantised.
//! Unknown keys are ignored; missing required keys, another model type or inconsistent shapes are
//! errors that name the field.

use std::path::Path;

use anyhow::{Context, Result, bail, ensure};
use serde::Deserialize;
use serde_json::Value;

use crate::quant::Quantization;

/// The token mixer of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (linear attention with a recurrent state).
    LinearAttention,
    /// Gated full softmax attention with a KV cache.
    FullAttention,
}

/// Hyper-parameters of the text model.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub rms_norm_eps: f32,
    pub layer_kinds: Vec<LayerKind>,
    // Full attention.
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// Number of leading dimensions of each head that RoPE rotates.
    pub rotary_dim: usize,
    pub rope_theta: f64,
    // Gated DeltaNet.
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    // Mixture of experts.
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub eos_token_ids: Vec<u32>,
    /// How the checkpoint's matrices are quantised (MLX-LM's `quantization` block), if at all.
    pub quantization: Option<Quantization>,
}

/// The raw text-model fields as they appear in the file (wrapper or text-only form).
#[derive(Deserialize)]
struct RawTextConfig {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    num_hidden_layers: usize,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    layer_types: Option<Vec<String>>,
    full_attention_interval: Option<usize>,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    head_dim: Option<usize>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default = "default_true")]
    attn_output_gate: bool,
    rope_parameters: Option<RawRope>,
    rope_theta: Option<f64>,
    partial_rotary_factor: Option<f64>,
    linear_num_key_heads: usize,
    linear_num_value_heads: usize,
    linear_key_head_dim: usize,
    linear_value_head_dim: usize,
    linear_conv_kernel_dim: usize,
    num_experts: usize,
    num_experts_per_tok: usize,
    moe_intermediate_size: usize,
    shared_expert_intermediate_size: usize,
    #[serde(default)]
    hidden_act: Option<String>,
    tie_word_embeddings: Option<bool>,
    #[serde(default = "default_max_positions")]
    max_position_embeddings: usize,
    eos_token_id: Option<Value>,
}

#[derive(Deserialize)]
struct RawRope {
    /// MLX-LM rewrites the key as `type` in the configs it saves.
    #[serde(alias = "type")]
    rope_type: Option<String>,
    rope_theta: Option<f64>,
    partial_rotary_factor: Option<f64>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_true() -> bool {
    true
}
fn default_max_positions() -> usize {
    262_144
}

/// The most layers a configuration may have.
const MAX_LAYERS: usize = 1 << 12;
/// The largest vocabulary and context a configuration may give.
const MAX_TABLE: usize = 1 << 24;
/// The largest width, head count or expert count a configuration may give: with these bounds
/// the products of sizes that lily computes stay far from overflowing.
const MAX_DIM: usize = 1 << 20;

impl ModelConfig {
    /// Reads `DIR/config.json`.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        Self::from_file(&dir.join("config.json"))
    }

    /// Reads a `config.json` at `path`; errors name the file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        Self::from_json_str(&text).with_context(|| format!("invalid {}", path.display()))
    }

    /// Parses the contents of a `config.json`.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let root: Value = serde_json::from_str(text).context("not valid JSON")?;
        let model_type = root.get("model_type").and_then(Value::as_str);
        let (text_value, outer_tie) = match model_type {
            Some("qwen3_5_moe") => {
                let text = root
                    .get("text_config")
                    .context("field `text_config` is missing (model_type qwen3_5_moe)")?;
                (
                    text.clone(),
                    root.get("tie_word_embeddings").and_then(Value::as_bool),
                )
            }
            Some("qwen3_5_moe_text") => (root.clone(), None),
            Some(other) => bail!(
                "field `model_type` is {other:?}: lily runs qwen3_5_moe (or qwen3_5_moe_text) models"
            ),
            None => bail!("field `model_type` is missing"),
        };
        let raw: RawTextConfig = serde_path_to_error::deserialize(text_value).map_err(|e| {
            let place = if model_type == Some("qwen3_5_moe") {
                "text_config."
            } else {
                ""
            };
            // The path of the field at fault: `text_config.hidden_size`, `rope_parameters`.
            match e.path().to_string().as_str() {
                "." => anyhow::anyhow!("{}", e.inner()),
                path => anyhow::anyhow!("field `{place}{path}`: {}", e.inner()),
            }
        })?;
        if let Some(t) = &raw.model_type {
            ensure!(
                t == "qwen3_5_moe_text" || t == "qwen3_5_moe",
                "field `text_config.model_type` is {t:?}, expected \"qwen3_5_moe_text\""
            );
        }
        let quantization = Quantization::from_config(&root)?;
        Self::from_raw(raw, outer_tie, quantization)
    }

    fn from_raw(
        raw: RawTextConfig,
        outer_tie: Option<bool>,
        quantization: Option<Quantization>,
    ) -> Result<Self> {
        ensure!(
            raw.num_hidden_layers > 0,
            "field `num_hidden_layers` must be positive"
        );
        // Before anything is sized by it.
        ensure!(
            raw.num_hidden_layers <= MAX_LAYERS,
            "field `num_hidden_layers` is {}, more than lily supports ({MAX_LAYERS})",
            raw.num_hidden_layers
        );
        let layer_kinds = match (&raw.layer_types, raw.full_attention_interval) {
            (Some(types), _) => {
                ensure!(
                    types.len() == raw.num_hidden_layers,
                    "field `layer_types` has {} entries but `num_hidden_layers` is {}",
                    types.len(),
                    raw.num_hidden_layers
                );
                types
                    .iter()
                    .enumerate()
                    .map(|(i, t)| match t.as_str() {
                        "linear_attention" => Ok(LayerKind::LinearAttention),
                        "full_attention" | "attention" => Ok(LayerKind::FullAttention),
                        other => bail!("field `layer_types[{i}]` is {other:?}"),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            (None, interval) => {
                let interval = interval.unwrap_or(4);
                ensure!(
                    interval > 0,
                    "field `full_attention_interval` must be positive"
                );
                (0..raw.num_hidden_layers)
                    .map(|i| {
                        if (i + 1) % interval == 0 {
                            LayerKind::FullAttention
                        } else {
                            LayerKind::LinearAttention
                        }
                    })
                    .collect()
            }
        };
        ensure!(
            !raw.attention_bias,
            "field `attention_bias` = true is not supported"
        );
        ensure!(
            raw.attn_output_gate,
            "field `attn_output_gate` = false is not supported (Qwen3.5 attention is gated)"
        );
        if let Some(act) = &raw.hidden_act {
            ensure!(
                act == "silu",
                "field `hidden_act` is {act:?}, only \"silu\" is supported"
            );
        }

        let rope = raw.rope_parameters.as_ref();
        if let Some(t) = rope.and_then(|r| r.rope_type.as_deref()) {
            ensure!(
                t == "default",
                "field `rope_parameters.rope_type` is {t:?}, only \"default\" is supported"
            );
        }
        let rope_theta = rope
            .and_then(|r| r.rope_theta)
            .or(raw.rope_theta)
            .unwrap_or(10_000.0);
        ensure!(
            rope_theta.is_finite() && rope_theta >= 1.0,
            "field `rope_theta` is {rope_theta}: the RoPE base must be at least 1 (below it the \
             frequencies grow instead of falling off)"
        );
        let partial = rope
            .and_then(|r| r.partial_rotary_factor)
            .or(raw.partial_rotary_factor)
            .unwrap_or(0.25);
        ensure!(
            partial > 0.0 && partial <= 1.0,
            "field `partial_rotary_factor` is {partial}: the share of each head's dims that RoPE \
             rotates must be above 0 and at most 1"
        );
        ensure!(
            raw.rms_norm_eps.is_finite() && raw.rms_norm_eps >= 0.0,
            "field `rms_norm_eps` is {}: it must be a number of at least 0",
            raw.rms_norm_eps
        );
        let head_dim = raw
            .head_dim
            .unwrap_or(raw.hidden_size / raw.num_attention_heads.max(1));
        // As the reference computes it: int(head_dim * partial_rotary_factor).
        let rotary_dim = (head_dim as f64 * partial) as usize;

        let eos_token_ids = match &raw.eos_token_id {
            None | Some(Value::Null) => Vec::new(),
            Some(v) => parse_ids(v).context("field `eos_token_id`")?,
        };

        let config = Self {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            rms_norm_eps: raw.rms_norm_eps as f32,
            layer_kinds,
            num_attention_heads: raw.num_attention_heads,
            num_key_value_heads: raw.num_key_value_heads,
            head_dim,
            rotary_dim,
            rope_theta,
            linear_num_key_heads: raw.linear_num_key_heads,
            linear_num_value_heads: raw.linear_num_value_heads,
            linear_key_head_dim: raw.linear_key_head_dim,
            linear_value_head_dim: raw.linear_value_head_dim,
            linear_conv_kernel_dim: raw.linear_conv_kernel_dim,
            num_experts: raw.num_experts,
            num_experts_per_tok: raw.num_experts_per_tok,
            moe_intermediate_size: raw.moe_intermediate_size,
            shared_expert_intermediate_size: raw.shared_expert_intermediate_size,
            tie_word_embeddings: raw.tie_word_embeddings.or(outer_tie).unwrap_or(false),
            max_position_embeddings: raw.max_position_embeddings,
            eos_token_ids,
            quantization,
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks that the shapes are consistent with each other.
    fn validate(&self) -> Result<()> {
        // Every size positive, and bounded far above any model of the family, so that no
        // product of sizes overflows.
        for (name, v, most) in [
            ("vocab_size", self.vocab_size, MAX_TABLE),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                MAX_TABLE,
            ),
            ("hidden_size", self.hidden_size, MAX_DIM),
            ("num_attention_heads", self.num_attention_heads, MAX_DIM),
            ("num_key_value_heads", self.num_key_value_heads, MAX_DIM),
            ("head_dim", self.head_dim, MAX_DIM),
            ("linear_num_key_heads", self.linear_num_key_heads, MAX_DIM),
            (
                "linear_num_value_heads",
                self.linear_num_value_heads,
                MAX_DIM,
            ),
            ("linear_key_head_dim", self.linear_key_head_dim, MAX_DIM),
            ("linear_value_head_dim", self.linear_value_head_dim, MAX_DIM),
            (
                "linear_conv_kernel_dim",
                self.linear_conv_kernel_dim,
                MAX_DIM,
            ),
            ("num_experts", self.num_experts, MAX_DIM),
            ("num_experts_per_tok", self.num_experts_per_tok, MAX_DIM),
            ("moe_intermediate_size", self.moe_intermediate_size, MAX_DIM),
            (
                "shared_expert_intermediate_size",
                self.shared_expert_intermediate_size,
                MAX_DIM,
            ),
        ] {
            ensure!(v > 0, "field `{name}` must be positive");
            ensure!(
                v <= most,
                "field `{name}` is {v}, more than lily supports ({most})"
            );
        }
        ensure!(
            self.num_attention_heads
                .is_multiple_of(self.num_key_value_heads),
            "field `num_attention_heads` ({}) is not a multiple of `num_key_value_heads` ({})",
            self.num_attention_heads,
            self.num_key_value_heads
        );
        ensure!(
            self.linear_num_value_heads
                .is_multiple_of(self.linear_num_key_heads),
            "field `linear_num_value_heads` ({}) is not a multiple of `linear_num_key_heads` ({})",
            self.linear_num_value_heads,
            self.linear_num_key_heads
        );
        ensure!(
            self.num_experts_per_tok <= self.num_experts,
            "field `num_experts_per_tok` ({}) exceeds `num_experts` ({})",
            self.num_experts_per_tok,
            self.num_experts
        );
        ensure!(
            self.rotary_dim.is_multiple_of(2) && self.rotary_dim <= self.head_dim,
            "RoPE covers {} dimensions of head_dim {}: it must be even and at most head_dim",
            self.rotary_dim,
            self.head_dim
        );
        for &id in &self.eos_token_ids {
            ensure!(
                (id as usize) < self.vocab_size,
                "field `eos_token_id` ({id}) is outside the vocabulary ({})",
                self.vocab_size
            );
        }
        Ok(())
    }

    pub fn num_layers(&self) -> usize {
        self.layer_kinds.len()
    }

    /// Width of the DeltaNet key (and query) projection: all key heads.
    pub fn linear_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }

    /// Width of the DeltaNet value projection: all value heads.
    pub fn linear_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }

    /// Channels of the DeltaNet causal convolution: query, key and value.
    pub fn linear_conv_dim(&self) -> usize {
        2 * self.linear_key_dim() + self.linear_value_dim()
    }
}

/// The ids that end generation for the checkpoint in `dir`: `generation_config.json`'s
/// `eos_token_id` when present, else the model configuration's.
pub fn eos_token_ids(dir: &Path, config: &ModelConfig) -> Result<Vec<u32>> {
    let path = dir.join("generation_config.json");
    if let Ok(text) = std::fs::read_to_string(&path) {
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        if let Some(eos) = v.get("eos_token_id").filter(|e| !e.is_null()) {
            let ids = parse_ids(eos)
                .with_context(|| format!("{}: field `eos_token_id`", path.display()))?;
            if let Some(id) = ids.iter().find(|&&id| id as usize >= config.vocab_size) {
                bail!(
                    "{}: field `eos_token_id` ({id}) is outside the vocabulary ({})",
                    path.display(),
                    config.vocab_size
                );
            }
            return Ok(ids);
        }
    }
    Ok(config.eos_token_ids.clone())
}

/// Parses an id or list of ids (`eos_token_id` may be either).
pub fn parse_ids(v: &Value) -> Result<Vec<u32>> {
    let one = |v: &Value| -> Result<u32> {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .with_context(|| format!("{v} is not a token id"))
    };
    match v {
        Value::Array(items) => items.iter().map(one).collect(),
        other => Ok(vec![one(other)?]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_config() -> Value {
        serde_json::json!({
            "model_type": "qwen3_5_moe_text",
            "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 8,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
            "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
            "eos_token_id": 7, "some_unknown_key": [1, 2, 3]
        })
    }

    #[test]
    fn layer_plan_from_interval() {
        let c = ModelConfig::from_json_str(&text_config().to_string()).unwrap();
        let full: Vec<usize> = (0..8)
            .filter(|&i| c.layer_kinds[i] == LayerKind::FullAttention)
            .collect();
        assert_eq!(full, vec![3, 7]);
        assert_eq!(c.rotary_dim, 4);
        assert_eq!(c.eos_token_ids, vec![7]);
        assert_eq!(c.linear_conv_dim(), 2 * 32 + 64);
    }

    #[test]
    fn wrapper_form_and_layer_types() {
        let mut text = text_config();
        text["num_hidden_layers"] = 2.into();
        text["layer_types"] = serde_json::json!(["full_attention", "linear_attention"]);
        let wrapper = serde_json::json!({"model_type": "qwen3_5_moe", "text_config": text});
        let c = ModelConfig::from_json_str(&wrapper.to_string()).unwrap();
        assert_eq!(
            c.layer_kinds,
            vec![LayerKind::FullAttention, LayerKind::LinearAttention]
        );
    }

    #[test]
    fn errors_name_the_field() {
        let err = |v: Value| {
            format!(
                "{:#}",
                ModelConfig::from_json_str(&v.to_string()).unwrap_err()
            )
        };
        let mut v = text_config();
        v["model_type"] = "llama".into();
        assert!(err(v).contains("model_type"));
        let mut v = text_config();
        v["num_key_value_heads"] = 3.into();
        assert!(err(v).contains("num_key_value_heads"));
        let mut v = text_config();
        v.as_object_mut().unwrap().remove("hidden_size");
        assert!(err(v).contains("hidden_size"));
        let mut v = text_config();
        v["layer_types"] = serde_json::json!(["full_attention"]);
        assert!(err(v).contains("layer_types"));
        let v = serde_json::json!({"model_type": "qwen3_5_moe"});
        assert!(err(v).contains("text_config"));
        assert!(ModelConfig::from_json_str("{not json").is_err());
        // A value of the wrong type names its field, nested ones by their path.
        let mut v = text_config();
        v["hidden_size"] = "64".into();
        assert!(err(v).contains("field `hidden_size`"));
        let mut v = text_config();
        v["rope_parameters"]["rope_theta"] = "big".into();
        assert!(err(v).contains("field `rope_parameters.rope_theta`"));
        let wrapper =
            serde_json::json!({"model_type": "qwen3_5_moe", "text_config": {"vocab_size": -1}});
        assert!(err(wrapper).contains("field `text_config.vocab_size`"));
    }

    #[test]
    fn generation_config_eos_ids_must_be_in_the_vocabulary() {
        let config = ModelConfig::from_json_str(&text_config().to_string()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(eos_token_ids(dir.path(), &config).unwrap(), vec![7]);
        let file = dir.path().join("generation_config.json");
        std::fs::write(&file, r#"{"eos_token_id": [5, 9]}"#).unwrap();
        assert_eq!(eos_token_ids(dir.path(), &config).unwrap(), vec![5, 9]);
        std::fs::write(&file, r#"{"eos_token_id": [5, 100]}"#).unwrap();
        let message = format!("{:#}", eos_token_ids(dir.path(), &config).unwrap_err());
        assert!(
            message.contains("generation_config.json") && message.contains("100"),
            "{message}"
        );
    }

    /// Values no model can have are refused before anything is sized by them: counts past what
    /// a product of sizes could hold, a RoPE base below 1, a rotary fraction outside (0, 1], a
    /// negative norm epsilon, an empty shared expert.
    #[test]
    fn impossible_values_are_refused() {
        let refused = |field: &str, value: Value| {
            let mut v = text_config();
            match field.split_once('.') {
                Some((outer, inner)) => v[outer][inner] = value.clone(),
                None => v[field] = value.clone(),
            }
            let message = format!(
                "{:#}",
                ModelConfig::from_json_str(&v.to_string()).unwrap_err()
            );
            let name = field.rsplit('.').next().unwrap_or(field);
            assert!(message.contains(name), "{field} = {value}: {message}");
        };
        refused("num_hidden_layers", (1u64 << 62).into());
        refused("num_attention_heads", ((1u64 << 62) + 4).into());
        refused("linear_key_head_dim", ((1u64 << 63) + 16).into());
        refused("vocab_size", (1u64 << 40).into());
        refused("rope_parameters.rope_theta", 0.into());
        refused("rope_parameters.rope_theta", (-1.0).into());
        refused("rope_parameters.partial_rotary_factor", (-0.5).into());
        refused("rope_parameters.partial_rotary_factor", 0.into());
        refused("rope_parameters.partial_rotary_factor", 1e30.into());
        refused("rms_norm_eps", (-1.0).into());
        refused("shared_expert_intermediate_size", 0.into());
    }
}

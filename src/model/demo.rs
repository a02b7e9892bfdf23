//! The embedded demo model: a small `qwen3_5_moe` model made at start-up, so that `lily serve`
//! works on a machine with nothing downloaded.
//!
//! This module owns the demo's configuration (4 layers: 3 Gated DeltaNet and 1 gated attention,
//! 8 small experts), its deterministic random weights (ChaCha20 with a fixed seed, drawn as
//! `scripts/make_fixtures.py` draws the test fixtures' so the random network stays
//! well-conditioned), its byte-level BPE tokenizer with the Qwen special tokens, and its chat
//! template (the official Qwen3.5/3.6 one). Its replies are random text: it shows the server
//! working, not a language model.

use anyhow::{Context, Result};
use rand_chacha::ChaCha20Rng;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use serde_json::{Value, json};

use super::Model;
use crate::checkpoint::{Checkpoint, DType, convert_from_f32};
use crate::config::{LayerKind, ModelConfig};
use crate::text::chat_template::ChatTemplate;
use crate::text::tokenizer::{Tokenizer, byte_level_char};

/// The name the demo goes by (in `/v1/models`, logs and responses).
pub const DEMO_MODEL_NAME: &str = "lily-demo";

/// The official Qwen3.5/3.6 chat template (tools in the XML form, `<think>` handling).
const CHAT_TEMPLATE: &str = include_str!("qwen3.5-chat_template.jinja");

/// Added tokens after the 256 byte tokens, in id order: `(content, special)`. Control tokens are
/// special; the tags the model writes as text are not, as in Qwen's tokenizer.
const ADDED_TOKENS: [(&str, bool); 9] = [
    ("<|endoftext|>", true),
    ("<|im_start|>", true),
    ("<|im_end|>", true),
    ("<think>", false),
    ("</think>", false),
    ("<tool_call>", false),
    ("</tool_call>", false),
    ("<tool_response>", false),
    ("</tool_response>", false),
];

const BYTE_TOKENS: usize = 256;
const VOCAB_SIZE: usize = BYTE_TOKENS + ADDED_TOKENS.len();
const HIDDEN: usize = 128;
const SEED: u64 = 0x6c69_6c79;

/// The demo: a model with its tokenizer, chat template and end-of-sequence ids.
pub struct Demo {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub chat_template: ChatTemplate,
    pub eos_token_ids: Vec<u32>,
}

/// Builds the demo (a few milliseconds; the weights take about 1 MB).
pub fn demo() -> Result<Demo> {
    let config = ModelConfig::from_json_str(&demo_config_json().to_string())
        .context("the demo model's configuration")?;
    let model = random_model(config).context("the demo model")?;
    let tokenizer = Tokenizer::from_json(&tokenizer_json().to_string())?;
    let eos_token_ids = model.config.eos_token_ids.clone();
    Ok(Demo {
        model,
        tokenizer,
        chat_template: ChatTemplate::from_source(CHAT_TEMPLATE)?,
        eos_token_ids,
    })
}

/// A model with the demo's kind of deterministic random weights for any configuration: tests
/// use it for shapes the checked-in fixtures do not have (start from [`demo_config_json`]).
pub fn random_model(config: ModelConfig) -> Result<Model> {
    let safetensors = random_safetensors(&config)?;
    let checkpoint = Checkpoint::from_memory(DEMO_MODEL_NAME, &safetensors)?;
    Model::from_checkpoint(config, &checkpoint).context("random weights")
}

fn added_token_id(content: &str) -> u32 {
    let index = ADDED_TOKENS
        .iter()
        .position(|(c, _)| *c == content)
        .expect("a demo added token");
    (BYTE_TOKENS + index) as u32
}

/// The demo's text-only `config.json`: the real model's proportions, scaled down.
pub fn demo_config_json() -> Value {
    json!({
        "model_type": "qwen3_5_moe_text",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        "eos_token_id": [added_token_id("<|im_end|>"), added_token_id("<|endoftext|>")],
        "tie_word_embeddings": false,
    })
}

/// Draws values with a given standard deviation (uniform, so bounded).
struct Draw(ChaCha20Rng);

impl Draw {
    fn uniform(&mut self, low: f32, high: f32) -> f32 {
        let unit = (self.0.next_u32() >> 8) as f32 / (1u32 << 24) as f32;
        low + (high - low) * unit
    }

    fn values(&mut self, count: usize, std: f32) -> Vec<f32> {
        let half_width = std * 3f32.sqrt();
        (0..count)
            .map(|_| self.uniform(-half_width, half_width))
            .collect()
    }
}

/// [`random_model`]'s weights as one safetensors file (f32) under the Hugging Face text-only
/// names: with its config.json, a checkpoint directory `lily convert` takes.
pub fn random_safetensors(c: &ModelConfig) -> Result<Vec<u8>> {
    random_safetensors_in(c, DType::F32)
}

/// [`random_safetensors`] with every tensor stored in `dtype` (rounded to nearest-even), as
/// real checkpoints store theirs in bf16.
pub fn random_safetensors_in(c: &ModelConfig, dtype: DType) -> Result<Vec<u8>> {
    let mut draw = Draw(ChaCha20Rng::seed_from_u64(SEED));
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let h = c.hidden_size;
    let mut add = |name: String, shape: Vec<usize>, values: Vec<f32>| {
        tensors.push((name, shape, values));
    };
    let matrix = |draw: &mut Draw, rows: usize, cols: usize| {
        draw.values(rows * cols, 0.6 / (cols as f32).sqrt())
    };

    add(
        "model.embed_tokens.weight".into(),
        vec![c.vocab_size, h],
        draw.values(c.vocab_size * h, 1.0),
    );
    // lm_head rows of printable ASCII (and newline) are at full scale, the others much smaller,
    // so the random replies are mostly readable characters instead of broken UTF-8. A tied
    // configuration has none: its checkpoints hold only the embedding (MLX-LM refuses others).
    if !c.tie_word_embeddings {
        let mut lm_head = Vec::with_capacity(c.vocab_size * h);
        for id in 0..c.vocab_size {
            let readable = id == b'\n' as usize
                || (0x20..0x7f).contains(&id)
                || id == added_token_id("<|im_end|>") as usize;
            let scale = if readable { 4.0 } else { 0.5 };
            lm_head.extend(draw.values(h, scale / (h as f32).sqrt()));
        }
        add("lm_head.weight".into(), vec![c.vocab_size, h], lm_head);
    }
    add("model.norm.weight".into(), vec![h], draw.values(h, 0.2));

    for (l, kind) in c.layer_kinds.iter().enumerate() {
        let p = format!("model.layers.{l}.");
        add(
            format!("{p}input_layernorm.weight"),
            vec![h],
            draw.values(h, 0.2),
        );
        add(
            format!("{p}post_attention_layernorm.weight"),
            vec![h],
            draw.values(h, 0.2),
        );
        match kind {
            LayerKind::FullAttention => {
                let (heads, kv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
                let a = format!("{p}self_attn.");
                for (name, rows, cols) in [
                    ("q_proj", heads * hd * 2, h),
                    ("k_proj", kv * hd, h),
                    ("v_proj", kv * hd, h),
                    ("o_proj", h, heads * hd),
                ] {
                    add(
                        format!("{a}{name}.weight"),
                        vec![rows, cols],
                        matrix(&mut draw, rows, cols),
                    );
                }
                add(format!("{a}q_norm.weight"), vec![hd], draw.values(hd, 0.2));
                add(format!("{a}k_norm.weight"), vec![hd], draw.values(hd, 0.2));
            }
            LayerKind::LinearAttention => {
                let (conv_dim, vd, hv) = (
                    c.linear_conv_dim(),
                    c.linear_value_dim(),
                    c.linear_num_value_heads,
                );
                let kernel = c.linear_conv_kernel_dim;
                let a = format!("{p}linear_attn.");
                for (name, rows, cols) in [
                    ("in_proj_qkv", conv_dim, h),
                    ("in_proj_z", vd, h),
                    ("in_proj_b", hv, h),
                    ("in_proj_a", hv, h),
                    ("out_proj", h, vd),
                ] {
                    add(
                        format!("{a}{name}.weight"),
                        vec![rows, cols],
                        matrix(&mut draw, rows, cols),
                    );
                }
                add(
                    format!("{a}conv1d.weight"),
                    vec![conv_dim, 1, kernel],
                    draw.values(conv_dim * kernel, 0.6 / (kernel as f32).sqrt()),
                );
                let a_log = (0..hv).map(|_| draw.uniform(1.0, 16.0).ln()).collect();
                add(format!("{a}A_log"), vec![hv], a_log);
                add(format!("{a}dt_bias"), vec![hv], draw.values(hv, 0.5));
                let dv = c.linear_value_head_dim;
                let norm = draw.values(dv, 0.2).into_iter().map(|w| 1.0 + w).collect();
                add(format!("{a}norm.weight"), vec![dv], norm);
            }
        }
        let (e, inter, shared) = (
            c.num_experts,
            c.moe_intermediate_size,
            c.shared_expert_intermediate_size,
        );
        let m = format!("{p}mlp.");
        add(
            format!("{m}gate.weight"),
            vec![e, h],
            matrix(&mut draw, e, h),
        );
        add(
            format!("{m}experts.gate_up_proj"),
            vec![e, 2 * inter, h],
            matrix(&mut draw, e * 2 * inter, h),
        );
        add(
            format!("{m}experts.down_proj"),
            vec![e, h, inter],
            matrix(&mut draw, e * h, inter),
        );
        for (name, rows, cols) in [
            ("gate_proj", shared, h),
            ("up_proj", shared, h),
            ("down_proj", h, shared),
        ] {
            add(
                format!("{m}shared_expert.{name}.weight"),
                vec![rows, cols],
                matrix(&mut draw, rows, cols),
            );
        }
        add(
            format!("{m}shared_expert_gate.weight"),
            vec![1, h],
            matrix(&mut draw, 1, h),
        );
    }

    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(name, shape, values)| {
            let mut data = Vec::new();
            convert_from_f32(dtype, &values, &mut data);
            (name, shape, data)
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(name, shape, data)| {
            safetensors::tensor::TensorView::new(dtype.safetensors(), shape.clone(), data)
                .map(|view| (name.as_str(), view))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(safetensors::tensor::serialize(views, None)?)
}

/// A byte-level BPE `tokenizer.json` without merges: one token per byte (id = byte value), then
/// the added tokens.
fn tokenizer_json() -> Value {
    let vocab: serde_json::Map<String, Value> = (0..=255u8)
        .map(|b| (byte_level_char(b).to_string(), json!(b)))
        .collect();
    let added: Vec<Value> = ADDED_TOKENS
        .iter()
        .enumerate()
        .map(|(i, (content, special))| {
            json!({
                "id": BYTE_TOKENS + i,
                "content": content,
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": special,
            })
        })
        .collect();
    let byte_level = json!({
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": false,
        "use_regex": true,
    });
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": [],
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::{Backend, LogitsFor};
    use std::sync::Arc;

    #[test]
    fn random_weights_stored_in_bf16_are_the_f32_ones_rounded() {
        let c = ModelConfig::from_json_str(&demo_config_json().to_string()).unwrap();
        let f32_bytes = random_safetensors(&c).unwrap();
        let bf16_bytes = random_safetensors_in(&c, DType::BF16).unwrap();
        let (wide, narrow) = (
            safetensors::SafeTensors::deserialize(&f32_bytes).unwrap(),
            safetensors::SafeTensors::deserialize(&bf16_bytes).unwrap(),
        );
        assert_eq!(wide.names().len(), narrow.names().len());
        for (name, t) in wide.tensors() {
            let n = narrow.tensor(&name).unwrap();
            assert_eq!(
                (n.dtype(), n.shape()),
                (safetensors::Dtype::BF16, t.shape())
            );
            let mut want = vec![0.0f32; t.data().len() / 4];
            crate::checkpoint::convert_to_f32(DType::F32, t.data(), &mut want);
            crate::checkpoint::round_to(DType::BF16, &mut want);
            let mut got = vec![0.0f32; want.len()];
            crate::checkpoint::convert_to_f32(DType::BF16, n.data(), &mut got);
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn tied_random_checkpoints_hold_no_lm_head() {
        let mut json = demo_config_json();
        json["tie_word_embeddings"] = true.into();
        let tied = ModelConfig::from_json_str(&json.to_string()).unwrap();
        let untied = ModelConfig::from_json_str(&demo_config_json().to_string()).unwrap();
        let names = |c: &ModelConfig| {
            let bytes = random_safetensors(c).unwrap();
            let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            file.names()
                .into_iter()
                .map(String::from)
                .collect::<Vec<_>>()
        };
        assert!(names(&untied).iter().any(|n| n == "lm_head.weight"));
        assert!(!names(&tied).iter().any(|n| n == "lm_head.weight"));
        random_model(tied).expect("a tied random model loads with the embedding as lm_head");
    }

    #[test]
    fn the_tokenizer_round_trips_any_text_and_knows_the_qwen_tokens() {
        let tokenizer = Tokenizer::from_json(&tokenizer_json().to_string()).unwrap();
        let text = "<|im_start|>user\nHé, 日本 \t ~!<|im_end|>\n<think>\n";
        let ids = tokenizer.encode(text).unwrap();
        assert_eq!(tokenizer.decode(&ids).unwrap(), text);
        assert_eq!(ids[0], added_token_id("<|im_start|>"));
        assert_eq!(ids[1], u32::from(b'u'));
        assert_eq!(tokenizer.token_id("</tool_call>"), Some(262));
        assert!(tokenizer.is_special(added_token_id("<|im_end|>")));
        assert!(!tokenizer.is_special(added_token_id("<think>")));
        assert_eq!(tokenizer.vocab_size(), VOCAB_SIZE);
        // "é" is two byte tokens; each token's bytes are half the character.
        let e_acute = tokenizer.encode("é").unwrap();
        assert_eq!(e_acute, [0xc3, 0xa9]);
        assert_eq!(tokenizer.token_bytes(0xc3).unwrap(), [0xc3]);
        assert_eq!(tokenizer.token_bytes(u32::from(b' ')).unwrap(), b" ");
        let think = added_token_id("<think>");
        assert_eq!(tokenizer.token_bytes(think).unwrap(), b"<think>");
    }

    #[test]
    fn the_demo_is_deterministic_and_runs() {
        let first = demo().unwrap();
        let second = demo().unwrap();
        let run = |d: Demo| {
            let backend = CpuBackend::new(Arc::new(d.model));
            let mut state = backend.new_state().unwrap();
            backend
                .prefill(&mut state, &[1, 2, 3], LogitsFor::Last)
                .unwrap()
        };
        let logits = run(first);
        assert_eq!(logits.len(), VOCAB_SIZE);
        assert!(logits.iter().all(|l| l.is_finite()));
        assert_eq!(logits, run(second));
    }

    #[test]
    fn the_template_renders_a_qwen_prompt() {
        let d = demo().unwrap();
        let prompt = d
            .chat_template
            .render(&json!({
                "messages": [{"role": "user", "content": "hi"}],
                "add_generation_prompt": true,
            }))
            .unwrap();
        assert_eq!(
            prompt,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
        );
    }
}

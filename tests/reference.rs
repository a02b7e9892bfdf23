//! The CPU backend against transformers' golden outputs on the tiny fixtures (made by
//! `scripts/make_fixtures.py`): logits on both paths, greedy continuations, and the agreement
//! of prefill and decode with each other.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use lily::backend::cpu::CpuBackend;
use lily::backend::{Backend, LogitsFor, argmax};
use lily::config::ModelConfig;
use lily::model::Model;
use lily::model::demo::{demo_config_json, random_model};
use safetensors::SafeTensors;

/// The tolerance of the issue: max |Δ| over max |golden| per prompt.
const TOLERANCE: f32 = 1e-4;

fn fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    ["tiny-wrapper", "tiny-text"]
        .iter()
        .map(|f| root.join(f))
        .collect()
}

struct Golden {
    prompts: Vec<Vec<u32>>,
    greedy: Vec<Vec<u32>>,
    logits: Vec<Vec<f32>>,
}

fn golden(dir: &Path) -> Golden {
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let ids =
        |v: &serde_json::Value| -> Vec<Vec<u32>> { serde_json::from_value(v.clone()).unwrap() };
    let bytes = std::fs::read(dir.join("golden.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let prompts = ids(&meta["prompts"]);
    let logits = (0..prompts.len())
        .map(|i| {
            let t = st.tensor(&format!("logits.{i}")).unwrap();
            t.data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        })
        .collect();
    Golden {
        prompts,
        greedy: ids(&meta["greedy"]),
        logits,
    }
}

fn backend(dir: &Path) -> CpuBackend {
    CpuBackend::new(Arc::new(Model::load(dir).expect("fixture loads")))
}

fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let max_diff = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    let max_ref = want.iter().map(|v| v.abs()).fold(0.0, f32::max);
    max_diff / max_ref
}

/// Decode-path logits: the prompt fed one token at a time.
fn decode_logits(b: &CpuBackend, prompt: &[u32]) -> Vec<f32> {
    let mut state = b.new_state().unwrap();
    prompt
        .iter()
        .flat_map(|&t| b.decode(&mut [&mut state], &[t]).unwrap())
        .collect()
}

#[test]
fn prefill_logits_match_transformers() {
    for dir in fixtures() {
        let (b, g) = (backend(&dir), golden(&dir));
        for (prompt, want) in g.prompts.iter().zip(&g.logits) {
            let mut state = b.new_state().unwrap();
            let got = b.prefill(&mut state, prompt, LogitsFor::All).unwrap();
            let err = relative_error(&got, want);
            assert!(err < TOLERANCE, "{}: prefill error {err}", dir.display());
        }
    }
}

#[test]
fn decode_logits_match_transformers() {
    for dir in fixtures() {
        let (b, g) = (backend(&dir), golden(&dir));
        for (prompt, want) in g.prompts.iter().zip(&g.logits) {
            let err = relative_error(&decode_logits(&b, prompt), want);
            assert!(err < TOLERANCE, "{}: decode error {err}", dir.display());
        }
    }
}

#[test]
fn greedy_continuation_matches_transformers() {
    for dir in fixtures() {
        let (b, g) = (backend(&dir), golden(&dir));
        let eos = &b.config().eos_token_ids;
        for (prompt, want) in g.prompts.iter().zip(&g.greedy) {
            let mut state = b.new_state().unwrap();
            let mut logits = b.prefill(&mut state, prompt, LogitsFor::Last).unwrap();
            let mut got = Vec::new();
            while got.len() < want.len() {
                let id = argmax(&logits);
                got.push(id);
                if eos.contains(&id) {
                    break;
                }
                logits = b.decode(&mut [&mut state], &[id]).unwrap();
            }
            assert_eq!(&got, want, "{}", dir.display());
        }
    }
}

#[test]
fn prefill_then_decode_equals_decode_only() {
    for dir in fixtures() {
        let (b, g) = (backend(&dir), golden(&dir));
        let prompt = &g.prompts[1];
        let vocab = b.config().vocab_size;
        let only_decode = decode_logits(&b, prompt);
        // Prefill in two uneven pieces (crossing a 64-token chunk), then decode the rest.
        let mut state = b.new_state().unwrap();
        let mut got = b
            .prefill(&mut state, &prompt[..70], LogitsFor::All)
            .unwrap();
        got.extend(
            b.prefill(&mut state, &prompt[70..74], LogitsFor::All)
                .unwrap(),
        );
        for &t in &prompt[74..] {
            got.extend(b.decode(&mut [&mut state], &[t]).unwrap());
        }
        assert_eq!(got.len(), prompt.len() * vocab);
        let err = relative_error(&got, &only_decode);
        assert!(err < TOLERANCE, "{}: {err}", dir.display());
    }
}

#[test]
fn batched_decode_equals_single_decode_and_states_clone() {
    let dir = &fixtures()[0];
    let (b, g) = (backend(dir), golden(dir));
    let (p0, p1) = (&g.prompts[0], &g.prompts[1]);
    let mut s0 = b.new_state().unwrap();
    let mut s1 = b.new_state().unwrap();
    b.prefill(&mut s0, p0, LogitsFor::Last).unwrap();
    b.prefill(&mut s1, p1, LogitsFor::Last).unwrap();
    let mut fork = b.fork(&s1).unwrap();
    let batched = b.decode(&mut [&mut s0, &mut s1], &[5, 9]).unwrap();
    let single = b.decode(&mut [&mut fork], &[9]).unwrap();
    let vocab = b.config().vocab_size;
    assert!(relative_error(&batched[vocab..], &single) < TOLERANCE);
    // The fork and the original advanced identically.
    assert_eq!(fork.position, s1.position);
    let again = b.decode(&mut [&mut s1], &[3]).unwrap();
    let again_fork = b.decode(&mut [&mut fork], &[3]).unwrap();
    assert!(relative_error(&again, &again_fork) < TOLERANCE);
}

#[test]
fn out_of_vocabulary_token_is_an_error() {
    let dir = &fixtures()[0];
    let b = backend(dir);
    let mut state = b.new_state().unwrap();
    let vocab = b.config().vocab_size as u32;
    let err = b
        .prefill(&mut state, &[1, vocab], LogitsFor::Last)
        .unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"));
}

/// Layouts the fixtures do not have (DeltaNet key and value heads of different widths, one KV
/// head, top-3 routing, a wider expert) on random weights: the chunked prefill path agrees with
/// token-by-token decode.
#[test]
fn prefill_equals_decode_for_other_layouts() {
    let layouts = [
        serde_json::json!({"linear_key_head_dim": 16, "linear_value_head_dim": 24}),
        serde_json::json!({"num_key_value_heads": 1, "num_experts_per_tok": 3, "moe_intermediate_size": 96}),
    ];
    for layout in layouts {
        let mut config = demo_config_json();
        for (key, value) in layout.as_object().unwrap() {
            config[key] = value.clone();
        }
        let config = ModelConfig::from_json_str(&config.to_string()).unwrap();
        let b = CpuBackend::new(Arc::new(random_model(config).unwrap()));
        let vocab = b.config().vocab_size;
        let prompt: Vec<u32> = (0..80u32).map(|i| (i * 37 + 11) % vocab as u32).collect();
        let only_decode = decode_logits(&b, &prompt);
        let mut state = b.new_state().unwrap();
        let got = b.prefill(&mut state, &prompt, LogitsFor::All).unwrap();
        let err = relative_error(&got, &only_decode);
        assert!(err < TOLERANCE, "{layout}: {err}");
    }
}

/// `CpuBackend::routing_margins`: a row per token of the last call, the same on both paths; zero
/// where two experts' router rows are equal (a tie at the top-1 boundary), positive and at most 2
/// (the gap of two logits over the larger |logit|) otherwise, infinite where every expert is
/// chosen.
#[test]
fn routing_margins_measure_the_gap_at_the_top_k_boundary() {
    use lily::checkpoint::Checkpoint;
    use lily::model::demo::random_safetensors;
    let margins_of = |experts: usize, top_k: usize, tie: bool| {
        let mut config = demo_config_json();
        config["num_experts"] = experts.into();
        config["num_experts_per_tok"] = top_k.into();
        let config = ModelConfig::from_json_str(&config.to_string()).unwrap();
        let bytes = random_safetensors(&config).unwrap();
        let bytes = if tie {
            // Every layer's router row of expert 1 made a copy of expert 0's.
            let st = SafeTensors::deserialize(&bytes).unwrap();
            let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
                .tensors()
                .into_iter()
                .map(|(name, t)| (name, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
                .collect();
            for (name, _, shape, data) in &mut tensors {
                if name.ends_with("mlp.gate.weight") {
                    let row = data.len() / shape[0];
                    let first = data[..row].to_vec();
                    data[row..2 * row].copy_from_slice(&first);
                }
            }
            let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
                .iter()
                .map(|(name, dtype, shape, data)| {
                    let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), data);
                    (name.clone(), view.unwrap())
                })
                .collect();
            safetensors::serialize(views, None).unwrap()
        } else {
            bytes
        };
        let checkpoint = Checkpoint::from_memory("routing ties", &bytes).unwrap();
        let model = Model::from_checkpoint(config, &checkpoint).unwrap();
        let b = CpuBackend::new(Arc::new(model));
        let prompt = [3u32, 9, 27, 81, 243, 17, 51];
        let mut state = b.new_state().unwrap();
        b.prefill(&mut state, &prompt, LogitsFor::Last).unwrap();
        let prefilled = b.routing_margins();
        let mut state = b.new_state().unwrap();
        let decoded: Vec<f32> = prompt
            .iter()
            .flat_map(|&t| {
                b.decode(&mut [&mut state], &[t]).unwrap();
                b.routing_margins()
            })
            .collect();
        assert_eq!(prefilled.len(), prompt.len());
        assert_eq!(decoded.len(), prompt.len());
        for (p, d) in prefilled.iter().zip(&decoded) {
            assert!(
                p == d || (p - d).abs() < 1e-4,
                "prefill {p} against decode {d}"
            );
        }
        prefilled
    };
    let drawn = margins_of(8, 2, false);
    assert!(drawn.iter().all(|&m| m > 0.0 && m <= 2.0), "{drawn:?}");
    assert!(margins_of(2, 1, true).iter().all(|&m| m == 0.0));
    assert!(margins_of(2, 1, false).iter().all(|&m| m > 0.0 && m <= 2.0));
    assert!(margins_of(4, 4, false).iter().all(|m| m.is_infinite()));
}

//! Quantised checkpoints end to end on the tiny fixtures: what `lily convert` writes has MLX-LM's
//! layout, loads, stays close to the bf16 model (mean KL divergence and top-1 agreement against
//! transformers' golden logits), agrees between prefill and decode, and a failed conversion
//! leaves nothing behind.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use lily::backend::cpu::CpuBackend;
use lily::backend::{Backend, LogitsFor};
use lily::convert::{ConvertOptions, DEFAULT_MAX_SHARD_BYTES, convert};
use lily::model::Model;
use lily::quant::QuantSpec;
use safetensors::{Dtype, SafeTensors};

mod common;
use common::relative_error;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn options(bits: u32, group_size: usize) -> ConvertOptions {
    ConvertOptions {
        spec: QuantSpec::new(bits, group_size).unwrap(),
        max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
        progress: false,
    }
}

/// Converts `src` into `DIR/out` and returns (DIR, DIR/out).
fn converted(src: &Path, options: &ConvertOptions) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    convert(src, &out, options).unwrap();
    (dir, out)
}

fn backend(dir: &Path) -> CpuBackend {
    CpuBackend::new(Arc::new(Model::load(dir).unwrap()))
}

/// Prompts and transformers' logits of a fixture (see tests/reference.rs).
fn golden(dir: &Path) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let prompts: Vec<Vec<u32>> = serde_json::from_value(meta["prompts"].clone()).unwrap();
    let bytes = std::fs::read(dir.join("golden.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let logits = (0..prompts.len())
        .map(|i| {
            let t = st.tensor(&format!("logits.{i}")).unwrap();
            t.data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        })
        .collect();
    (prompts, logits)
}

fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
    row.iter().map(|&v| v as f64 - max - sum.ln()).collect()
}

fn argmax(row: &[f32]) -> usize {
    (0..row.len())
        .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
        .unwrap()
}

/// Mean KL(reference ‖ quantised) per position, and the share of positions whose top token agrees.
fn compare(reference: &[f32], quantised: &[f32], vocab: usize) -> (f64, f64) {
    let mut kl_sum = 0.0;
    let mut agree = 0;
    let rows = reference.len() / vocab;
    for (r, q) in reference
        .chunks_exact(vocab)
        .zip(quantised.chunks_exact(vocab))
    {
        let (lr, lq) = (log_softmax(r), log_softmax(q));
        kl_sum += lr
            .iter()
            .zip(&lq)
            .map(|(a, b)| a.exp() * (a - b))
            .sum::<f64>();
        agree += usize::from(argmax(r) == argmax(q));
    }
    (kl_sum / rows as f64, agree as f64 / rows as f64)
}

fn prefill_all(b: &CpuBackend, prompt: &[u32]) -> Vec<f32> {
    b.prefill(&mut b.new_state().unwrap(), prompt, LogitsFor::All)
        .unwrap()
}

#[test]
fn quantised_logits_stay_close_to_bf16() {
    // (bits, group size, largest mean KL, smallest top-1 agreement). These random models are
    // chaotic (flat next-token distributions, small top-1 margins), so 4-bit moves them a lot; the
    // bounds sit about 1.5x above the worst KL measured here and 0.06 below the worst agreement.
    let settings = [
        (4, 64, 0.32, 0.65),
        (4, 32, 0.25, 0.70),
        (4, 128, 0.34, 0.66),
        (8, 64, 0.007, 0.88),
    ];
    println!("fixture       setting  mean KL   top-1");
    for name in ["tiny-wrapper", "tiny-text"] {
        let src = fixture(name);
        let (prompts, reference) = golden(&src);
        for (bits, group, max_kl, min_top1) in settings {
            let (_dir, out) = converted(&src, &options(bits, group));
            let b = backend(&out);
            let vocab = b.config().vocab_size;
            let (reference, quantised): (Vec<f32>, Vec<f32>) = (
                reference.concat(),
                prompts.iter().flat_map(|p| prefill_all(&b, p)).collect(),
            );
            let (kl, top1) = compare(&reference, &quantised, vocab);
            println!("{name:13} {bits}-bit g{group:<3} {kl:.6}  {top1:.3}");
            assert!(
                kl <= max_kl && top1 >= min_top1,
                "{name} {bits}-bit g{group}: KL {kl}, top-1 {top1}"
            );
        }
    }
}

#[test]
fn prefill_and_decode_agree_on_a_quantised_model() {
    let src = fixture("tiny-wrapper");
    let (_dir, out) = converted(&src, &options(4, 64));
    let b = backend(&out);
    let (prompts, _) = golden(&src);
    let prompt = &prompts[1];
    let mut state = b.new_state().unwrap();
    let decoded: Vec<f32> = prompt
        .iter()
        .flat_map(|&t| b.decode(&mut [&mut state], &[t]).unwrap())
        .collect();
    let err = relative_error(&prefill_all(&b, prompt), &decoded);
    assert!(err < 1e-4, "prefill vs decode: {err}");
}

/// The tensors of a converted checkpoint, by name: (dtype, shape, bytes).
fn tensors(dir: &Path) -> std::collections::BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> {
    let mut all = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            for (name, t) in st.iter() {
                let value = (t.dtype(), t.shape().to_vec(), t.data().to_vec());
                all.insert(name.to_string(), value);
            }
        }
    }
    all
}

fn config(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

#[test]
fn converted_checkpoint_has_the_mlx_layout() {
    let src = fixture("tiny-wrapper");
    let (_dir, out) = converted(&src, &options(4, 64));
    let t = tensors(&out);
    let p = "language_model.model.layers.0.";
    // Quantised linear layers: packed words, bf16 scales and biases per group of 64.
    let (dtype, shape, _) = &t[&format!("{p}linear_attn.in_proj_qkv.weight")];
    assert_eq!((*dtype, shape.as_slice()), (Dtype::U32, &[256, 16][..]));
    let (dtype, shape, _) = &t[&format!("{p}linear_attn.in_proj_qkv.scales")];
    assert_eq!((*dtype, shape.as_slice()), (Dtype::BF16, &[256, 2][..]));
    // Experts stacked; routers and shared-expert gates at 8 bits.
    assert_eq!(
        t[&format!("{p}mlp.switch_mlp.down_proj.weight")].1,
        [8, 128, 8]
    );
    assert_eq!(t[&format!("{p}mlp.gate.weight")].1, [8, 32]);
    assert_eq!(t[&format!("{p}mlp.shared_expert_gate.weight")].1, [1, 32]);
    // Sanitised: conv1d [channels, kernel, 1], A_log kept in f32, no vision or MTP tensors.
    assert_eq!(t[&format!("{p}linear_attn.conv1d.weight")].1, [256, 4, 1]);
    assert_eq!(t[&format!("{p}linear_attn.A_log")].0, Dtype::F32);
    assert!(t.contains_key("language_model.lm_head.scales"));
    assert!(t.keys().all(|k| k.starts_with("language_model.")));
    assert!(!t.keys().any(|k| k.contains("mtp.") || k.contains("visual")));
    // The RMSNorm weights carry the +1.
    let source = Model::load(&src).unwrap();
    let (_, _, norm) = &t["language_model.model.norm.weight"];
    let stored: Vec<f32> = norm
        .chunks_exact(2)
        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect();
    for (s, want) in stored.iter().zip(&source.final_norm) {
        assert_eq!(*s, half::bf16::from_f32(*want).to_f32());
    }

    let c = config(&out);
    let q = &c["quantization"];
    assert_eq!(
        (&q["bits"], &q["group_size"], &q["mode"]),
        (&4.into(), &64.into(), &"affine".into())
    );
    for layer in 0..4 {
        for gate in ["mlp.gate", "mlp.shared_expert_gate"] {
            let key = format!("language_model.model.layers.{layer}.{gate}");
            assert_eq!(
                q[&key],
                serde_json::json!({"group_size": 64, "bits": 8}),
                "{key}"
            );
        }
    }
    assert_eq!(c["quantization_config"], *q);
    assert!(c.get("vision_config").is_none());
    assert_eq!(c["eos_token_id"], 1000);
    assert!(out.join("generation_config.json").is_file());
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(index["weight_map"].as_object().unwrap().len(), t.len());
}

#[test]
fn group_128_leaves_narrower_matrices_dense() {
    // The experts' down projections have 64 inputs: MLX-LM keeps them unquantised at group 128.
    let (_dir, out) = converted(&fixture("tiny-wrapper"), &options(4, 128));
    let t = tensors(&out);
    let down = "language_model.model.layers.0.mlp.switch_mlp.down_proj";
    assert_eq!(t[&format!("{down}.weight")].0, Dtype::BF16);
    assert_eq!(t[&format!("{down}.weight")].1, [8, 128, 64]);
    assert!(!t.contains_key(&format!("{down}.scales")));
    // The gates still take group 64 at 8 bits.
    assert_eq!(
        t["language_model.model.layers.0.mlp.gate.weight"].1,
        [8, 32]
    );
    backend(&out);
}

#[test]
fn sharded_output_equals_single_file_output() {
    let src = fixture("tiny-text");
    let (_one, single) = converted(&src, &options(4, 64));
    let mut small = options(4, 64);
    small.max_shard_bytes = 300_000;
    let (_many, sharded) = converted(&src, &small);
    let shards = std::fs::read_dir(&sharded)
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            name.to_string_lossy().ends_with(".safetensors")
        })
        .count();
    assert!(shards > 2, "{shards} shards");
    let first = format!("model-00001-of-{shards:05}.safetensors");
    assert!(sharded.join(first).is_file());
    assert_eq!(tensors(&single), tensors(&sharded));
    let prompt = &golden(&src).0[0];
    assert_eq!(
        prefill_all(&backend(&single), prompt),
        prefill_all(&backend(&sharded), prompt)
    );
}

/// Entries of `dir` (to check that failures leave nothing behind).
fn entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn bad_source_or_destination_fails_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    // A source missing a tensor: the error names it, nothing is written.
    let src = dir.path().join("src");
    std::fs::create_dir(&src).unwrap();
    let fixture_dir = fixture("tiny-text");
    std::fs::copy(fixture_dir.join("config.json"), src.join("config.json")).unwrap();
    let bytes = std::fs::read(fixture_dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let missing = "model.layers.1.self_attn.o_proj.weight";
    let kept: Vec<_> = st.iter().filter(|(n, _)| *n != missing).collect();
    safetensors::serialize_to_file(kept, None, &src.join("model.safetensors")).unwrap();
    let out = dir.path().join("out");
    let err = format!("{:#}", convert(&src, &out, &options(4, 64)).unwrap_err());
    assert!(err.contains(missing), "{err}");
    assert_eq!(entries(dir.path()), ["src"]);

    // An existing destination is refused and left alone.
    std::fs::create_dir(&out).unwrap();
    let err = format!(
        "{:#}",
        convert(&fixture_dir, &out, &options(4, 64)).unwrap_err()
    );
    assert!(err.contains("already exists"), "{err}");
    assert!(entries(&out).is_empty());

    // A quantised checkpoint is not converted again.
    let (_q, quantised) = converted(&fixture_dir, &options(4, 64));
    let err = format!(
        "{:#}",
        convert(&quantised, &dir.path().join("again"), &options(4, 64)).unwrap_err()
    );
    assert!(err.contains("quantization"), "{err}");
}

#[test]
fn failed_write_leaves_nothing_that_looks_valid() {
    // A file-size limit makes writes fail as a full disk would (SIGXFSZ ignored: EFBIG).
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let status = Command::new("bash")
        .arg("-c")
        .arg(r#"trap '' XFSZ; ulimit -f 200; exec "$0" convert --model "$1" --out "$2""#)
        .arg(env!("CARGO_BIN_EXE_lily"))
        .arg(fixture("tiny-text"))
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&status.stderr);
    assert!(!status.status.success());
    assert!(
        stderr.contains("model.safetensors") && stderr.contains("large"),
        "{stderr}"
    );
    assert!(entries(dir.path()).is_empty(), "{:?}", entries(dir.path()));
}

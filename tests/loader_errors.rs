//! Bad checkpoints give clear errors naming the file and tensor at fault, never a panic.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use lily::model::Model;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A copy of the single-file `tiny-text` fixture whose tensors went through `edit`.
fn edited_checkpoint(
    edit: impl FnOnce(&mut BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>),
) -> tempfile::TempDir {
    let src = fixture("tiny-text");
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> = st
        .iter()
        .map(|(n, t)| {
            (
                n.to_string(),
                (t.dtype(), t.shape().to_vec(), t.data().to_vec()),
            )
        })
        .collect();
    edit(&mut tensors);
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    dir
}

fn load_error(dir: &Path) -> String {
    match Model::load(dir) {
        Ok(_) => panic!("{} loaded but should not", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

const SOME_TENSOR: &str = "model.layers.0.linear_attn.in_proj_z.weight";

#[test]
fn unedited_copy_loads() {
    let dir = edited_checkpoint(|_| {});
    Model::load(dir.path()).unwrap();
}

#[test]
fn missing_tensor_is_named() {
    let dir = edited_checkpoint(|t| {
        t.remove(SOME_TENSOR);
    });
    let err = load_error(dir.path());
    assert!(
        err.contains(SOME_TENSOR) && err.contains("missing"),
        "{err}"
    );
}

#[test]
fn missing_expert_is_named() {
    let name = "model.layers.2.mlp.experts.7.down_proj.weight";
    let dir = edited_checkpoint(|t| {
        t.remove(name);
    });
    let err = load_error(dir.path());
    assert!(err.contains(name), "{err}");
}

#[test]
fn wrong_shape_names_tensor_and_file() {
    let dir = edited_checkpoint(|t| {
        let (_, shape, bytes) = t.get_mut(SOME_TENSOR).unwrap();
        let half = bytes.len() / 2;
        bytes.truncate(half);
        shape[0] /= 2;
    });
    let err = load_error(dir.path());
    assert!(err.contains(SOME_TENSOR), "{err}");
    assert!(
        err.contains("model.safetensors") && err.contains("shape"),
        "{err}"
    );
}

#[test]
fn wrong_dtype_names_tensor_and_file() {
    let dir = edited_checkpoint(|t| {
        let (dtype, shape, bytes) = t.get_mut(SOME_TENSOR).unwrap();
        // Same byte count as f16, but as 16-bit integers.
        *dtype = Dtype::I16;
        assert_eq!(bytes.len(), shape.iter().product::<usize>() * 2);
    });
    let err = load_error(dir.path());
    assert!(err.contains(SOME_TENSOR) && err.contains("I16"), "{err}");
    assert!(err.contains("model.safetensors"), "{err}");
}

/// A header whose dtype or shape no longer matches a tensor's bytes names that tensor (the
/// safetensors crate's own message does not).
#[test]
fn header_size_mismatch_names_the_tensor() {
    for (field, value) in [
        ("dtype", serde_json::json!("F32")),
        ("shape", serde_json::json!([3, 5])),
    ] {
        let dir = edited_checkpoint(|_| {});
        let path = dir.path().join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
        header[SOME_TENSOR][field] = value;
        let mut text = header.to_string().into_bytes();
        text.resize(text.len().next_multiple_of(8), b' ');
        let mut edited = (text.len() as u64).to_le_bytes().to_vec();
        edited.extend(&text);
        edited.extend(&bytes[8 + len..]);
        std::fs::write(&path, edited).unwrap();
        let err = load_error(dir.path());
        assert!(
            err.contains("model.safetensors") && err.contains(SOME_TENSOR),
            "{field}: {err}"
        );
    }
}

#[test]
fn truncated_file_is_named() {
    let dir = edited_checkpoint(|_| {});
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 1000]).unwrap();
    let err = load_error(dir.path());
    assert!(
        err.contains("model.safetensors") && err.contains("truncated"),
        "{err}"
    );
}

#[test]
fn corrupt_header_is_named() {
    let dir = edited_checkpoint(|_| {});
    let path = dir.path().join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..20].copy_from_slice(b"not json!!!!");
    std::fs::write(&path, &bytes).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("model.safetensors"), "{err}");
    // An empty file too.
    std::fs::write(&path, b"").unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("model.safetensors"), "{err}");
}

#[test]
fn index_naming_a_missing_shard_is_named() {
    let src = fixture("tiny-wrapper");
    let dir = tempfile::tempdir().unwrap();
    for f in [
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
    ] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let err = load_error(dir.path());
    assert!(err.contains("model-00002-of-00002.safetensors"), "{err}");
    assert!(err.contains("missing"), "{err}");
}

#[test]
fn corrupt_index_is_named() {
    let src = fixture("tiny-wrapper");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        "{\"weight_map\": 3}",
    )
    .unwrap();
    let err = load_error(dir.path());
    assert!(
        err.contains("model.safetensors.index.json") && err.contains("weight_map"),
        "{err}"
    );
}

#[test]
fn config_problems_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("config.json"), "{err}");

    let config = std::fs::read_to_string(fixture("tiny-text").join("config.json")).unwrap();
    let bad = config.replace("qwen3_5_moe_text", "qwen2");
    std::fs::write(dir.path().join("config.json"), bad).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("model_type") && err.contains("qwen2"), "{err}");

    // A config whose shapes disagree with the weights: the tensor is named.
    let mut v: serde_json::Value = serde_json::from_str(&config).unwrap();
    v["moe_intermediate_size"] = 32.into();
    std::fs::write(dir.path().join("config.json"), v.to_string()).unwrap();
    std::fs::copy(
        fixture("tiny-text").join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    let err = load_error(dir.path());
    assert!(
        err.contains("shape") && err.contains("model.layers.0.mlp"),
        "{err}"
    );
}

#[test]
fn no_weights_at_all() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture("tiny-text").join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("safetensors"), "{err}");
}

/// A 4-bit conversion of `tiny-text` (one file) whose tensors went through `edit` and whose
/// `config.json` through `edit_config`.
fn edited_quantised_checkpoint(
    edit: impl FnOnce(&mut BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>),
    edit_config: impl FnOnce(&mut serde_json::Value),
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let options = lily::convert::ConvertOptions {
        spec: lily::quant::QuantSpec::new(4, 64).unwrap(),
        max_shard_bytes: lily::convert::DEFAULT_MAX_SHARD_BYTES,
        progress: false,
    };
    let out = dir.path().join("q");
    lily::convert::convert(&fixture("tiny-text"), &out, &options).unwrap();
    let weights = out.join("model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> = st
        .iter()
        .map(|(n, t)| {
            let value = (t.dtype(), t.shape().to_vec(), t.data().to_vec());
            (n.to_string(), value)
        })
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &weights).unwrap();
    std::fs::remove_file(out.join("model.safetensors.index.json")).unwrap();
    let config_path = out.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    edit_config(&mut config);
    std::fs::write(&config_path, config.to_string()).unwrap();
    dir
}

fn quantised_load_error(
    edit: impl FnOnce(&mut BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>),
    edit_config: impl FnOnce(&mut serde_json::Value),
) -> String {
    let dir = edited_quantised_checkpoint(edit, edit_config);
    load_error(&dir.path().join("q"))
}

const PROJ: &str = "language_model.model.layers.0.linear_attn.in_proj_z";
const ROUTER: &str = "language_model.model.layers.0.mlp.gate";

#[test]
fn unedited_quantised_copy_loads() {
    let dir = edited_quantised_checkpoint(|_| {}, |_| {});
    Model::load(&dir.path().join("q")).unwrap();
}

#[test]
fn unsupported_quantisation_settings_name_the_field() {
    for (key, value, field) in [
        ("bits", serde_json::json!(3), "quantization.bits"),
        ("bits", serde_json::json!(5), "quantization.bits"),
        (
            "group_size",
            serde_json::json!(16),
            "quantization.group_size",
        ),
        ("mode", serde_json::json!("mxfp4"), "quantization.mode"),
    ] {
        let err = quantised_load_error(|_| {}, |c| c["quantization"][key] = value.clone());
        assert!(err.contains(field) && err.contains("config.json"), "{err}");
    }
    let err = quantised_load_error(
        |_| {},
        |c| c["quantization"][ROUTER] = serde_json::json!({"bits": 2, "group_size": 64}),
    );
    assert!(err.contains(ROUTER) && err.contains("bits"), "{err}");
    let err = quantised_load_error(
        |_| {},
        |c| {
            let q = c.as_object_mut().unwrap();
            q.remove("quantization");
            q["quantization_config"] = serde_json::json!({"quant_method": "gptq", "bits": 4});
        },
    );
    assert!(
        err.contains("quant_method") && err.contains("gptq"),
        "{err}"
    );
}

#[test]
fn override_disagreeing_with_the_tensors_is_named() {
    // The router is stored at 8 bits; config.json claiming 4 bits gives a shape error.
    let err = quantised_load_error(
        |_| {},
        |c| c["quantization"][ROUTER] = serde_json::json!({"bits": 4, "group_size": 64}),
    );
    assert!(
        err.contains(&format!("{ROUTER}.weight")) && err.contains("shape"),
        "{err}"
    );
}

#[test]
fn missing_scales_or_biases_are_named() {
    let err = quantised_load_error(|t| drop(t.remove(&format!("{PROJ}.scales"))), |_| {});
    assert!(
        err.contains(&format!("{PROJ}.scales")) && err.contains("missing"),
        "{err}"
    );
    let err = quantised_load_error(|t| drop(t.remove(&format!("{PROJ}.biases"))), |_| {});
    assert!(
        err.contains(&format!("{PROJ}.biases")) && err.contains("missing"),
        "{err}"
    );
    // The router's override says it is quantised.
    let err = quantised_load_error(|t| drop(t.remove(&format!("{ROUTER}.scales"))), |_| {});
    assert!(err.contains(&format!("{ROUTER}.scales")), "{err}");
}

#[test]
fn scales_without_a_quantization_block_are_refused() {
    let err = quantised_load_error(
        |_| {},
        |c| {
            let q = c.as_object_mut().unwrap();
            q.remove("quantization");
            q.remove("quantization_config");
        },
    );
    assert!(
        err.contains("quantization") && err.contains(".scales"),
        "{err}"
    );
}

#[test]
fn bad_packed_tensors_are_named() {
    // Packed words stored as signed integers.
    let err = quantised_load_error(
        |t| t.get_mut(&format!("{PROJ}.weight")).unwrap().0 = Dtype::I32,
        |_| {},
    );
    assert!(
        err.contains(&format!("{PROJ}.weight")) && err.contains("U32"),
        "{err}"
    );
    // Half the words of each row: as if 2-bit, which lily does not read.
    let err = quantised_load_error(
        |t| {
            let (_, shape, bytes) = t.get_mut(&format!("{PROJ}.weight")).unwrap();
            let (rows, words) = (shape[0], shape[1]);
            *bytes = bytes
                .chunks_exact(words * 4)
                .flat_map(|row| row[..words * 2].to_vec())
                .collect();
            *shape = vec![rows, words / 2];
        },
        |_| {},
    );
    assert!(
        err.contains(&format!("{PROJ}.weight")) && err.contains("2-bit"),
        "{err}"
    );
    // Scales and biases of different dtypes.
    let err = quantised_load_error(
        |t| t.get_mut(&format!("{PROJ}.biases")).unwrap().0 = Dtype::F16,
        |_| {},
    );
    assert!(err.contains(&format!("{PROJ}.biases")), "{err}");
}

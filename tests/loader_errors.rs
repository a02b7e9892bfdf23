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

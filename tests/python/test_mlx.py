"""lily against MLX-LM, the peer that defines the quantised checkpoint format.

For each quantisation setting, the tiny-wrapper fixture is converted by both `lily convert` and
`mlx_lm.convert`; then
- lily's checkpoint loads in MLX-LM and gives the logits lily gives,
- MLX-LM's checkpoint loads in lily and gives the logits MLX-LM gives,
both within 1e-3 relative (max |difference| over max |logit|; MLX-LM computing in float32), and
- the two converters write the same tensors, byte for byte, and the same `quantization` block.

The binary is `$LILY_BIN` (default target/release/lily).
"""

import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import convert, load

ROOT = Path(__file__).resolve().parents[2]
LILY = os.environ.get("LILY_BIN", str(ROOT / "target" / "release" / "lily"))
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-wrapper"
TOLERANCE = 1e-3
SETTINGS = [(4, 64), (8, 64), (4, 32)]


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the fixture's ids: MLX-LM's load and convert need one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0").save_pretrained(directory)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("source") / "tiny-wrapper"
    shutil.copytree(FIXTURE, directory)
    config = json.loads((directory / "config.json").read_text())
    write_tokenizer(directory, config["text_config"]["vocab_size"])
    return directory


@pytest.fixture(scope="module", params=SETTINGS, ids=lambda s: f"{s[0]}bit-g{s[1]}")
def converted(request, source, tmp_path_factory) -> SimpleNamespace:
    bits, group_size = request.param
    base = tmp_path_factory.mktemp(f"q{bits}g{group_size}")
    lily_dir, mlx_dir = base / "lily", base / "mlx"
    subprocess.run(
        [LILY, "convert", "--model", source, "--out", lily_dir,
         "--bits", str(bits), "--group-size", str(group_size)],
        check=True,
    )
    convert(str(source), str(mlx_dir), quantize=True, q_bits=bits, q_group_size=group_size)
    return SimpleNamespace(lily=lily_dir, mlx=mlx_dir, setting=f"{bits}-bit g{group_size}")


def prompts() -> list[list[int]]:
    return json.loads((FIXTURE / "golden.json").read_text())["prompts"]


def lily_logits(model: Path, ids: list[int]) -> np.ndarray:
    out = subprocess.run(
        [LILY, "logits", "--model", model, "--prompt-ids", ",".join(map(str, ids))],
        check=True, capture_output=True, text=True,
    )
    return np.array(json.loads(out.stdout)["logits"], dtype=np.float32)


def mlx_logits(model: Path, ids: list[int]) -> np.ndarray:
    network, _ = load(str(model))
    network.set_dtype(mx.float32)
    return np.array(network(mx.array([ids]))[0], dtype=np.float32)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_lily_checkpoint_runs_the_same_in_mlx_lm(converted):
    for ids in prompts():
        err = relative_error(lily_logits(converted.lily, ids), mlx_logits(converted.lily, ids))
        print(f"lily convert {converted.setting}, {len(ids)} tokens: MLX-LM vs lily {err:.2e}")
        assert err < TOLERANCE


def test_mlx_lm_checkpoint_runs_the_same_in_lily(converted):
    for ids in prompts():
        err = relative_error(lily_logits(converted.mlx, ids), mlx_logits(converted.mlx, ids))
        print(f"mlx_lm.convert {converted.setting}, {len(ids)} tokens: lily vs MLX-LM {err:.2e}")
        assert err < TOLERANCE


def tensors(model: Path) -> dict[str, mx.array]:
    found = {}
    for file in sorted(model.glob("model*.safetensors")):
        found.update(mx.load(str(file)))
    return found


def raw_bytes(a: mx.array) -> bytes:
    # numpy has no bfloat16: compare the bits.
    return bytes(np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes())


def test_both_converters_write_the_same_checkpoint(converted):
    ours, theirs = tensors(converted.lily), tensors(converted.mlx)
    assert sorted(ours) == sorted(theirs)
    for name, a in ours.items():
        b = theirs[name]
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        assert raw_bytes(a) == raw_bytes(b), name
    ours_config = json.loads((converted.lily / "config.json").read_text())
    theirs_config = json.loads((converted.mlx / "config.json").read_text())
    assert ours_config["quantization"] == theirs_config["quantization"]
    assert ours_config["quantization_config"] == theirs_config["quantization_config"]
    assert sorted(ours_config) == sorted(theirs_config)

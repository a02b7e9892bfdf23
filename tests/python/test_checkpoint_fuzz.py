"""lily on seeded-random broken checkpoints: a clear error or a correct run, never a crash.

tests/loader_errors.rs checks one hand-made corruption of each kind through the library. This file
mutates copies of the tiny fixtures (`tiny-wrapper`: bf16, Hugging Face wrapper layout, two shards
and an index; `tiny-text`: f16, text-only layout, one unindexed file; `tiny-q4`: tiny-wrapper
through `lily convert --bits 4 --group-size 64`, MLX-LM layout) a few hundred ways, and runs the
lily binary on every mutant:

* `config.json`: every numeric field set to 0, -1, 1, 2^31, 2^62, 1e30, a fraction, a string,
  null, a list, true, its value plus 2^62 or 2^63 (products of such values wrap around), 1e999,
  NaN, or deleted; `layer_types`, `rope_parameters`, `eos_token_id`, the flags and the `quantization`
  block mangled; wrapper and text-only forms confused; invalid JSON, an empty file, non-objects;
* safetensors files: the header length prefix, the header's dtypes, shapes and data offsets, the
  header's bytes at random, truncation, tensors deleted, renamed, added or duplicated across
  shards, and (tiny-q4) packed weights, scales and biases disagreeing with each other;
* `model.safetensors.index.json`: invalid, naming missing or wrong shards, or gone;
* consistent edits that leave a valid if unusual checkpoint (a narrower or zero-padded shared
  expert, another convolution kernel size, an empty `quantization` block), or one lily refuses
  cleanly (a zero-width shared expert);
* `generation_config.json` (read by `generate` and `convert`).

Each mutant goes through `lily logits --model DIR --prompt-ids 1,2,3`; if that succeeds, through
`lily generate --prompt-ids 1,2 --max-tokens 2 --json` too; and a mutated bf16 source through
`lily convert` (whose output, if any, must run). For every command:

* it exits 0 or 1: never a panic (101), a signal (an abort, say after a failed allocation) or a
  hang; each runs under a 1 GiB address-space limit (the fixtures need under 256 MiB;
  RAYON_NUM_THREADS is pinned so that the limit does not depend on the machine), so a config
  asking for absurd sizes must be refused up front, not allocated;
* exit 1 comes with one line, `error: ...`, on stderr; a mutant that cannot be a valid checkpoint
  must get it (a config whose sizes no longer fit the tensors, a `rope_theta` of 0, a negative
  `rms_norm_eps`, say), and a failed `convert` leaves no output or staging directory behind;
* exit 0 comes with well-formed output: finite logits, a JSON generation;
* an error should name the file, tensor or field at fault: where it does not, a warning
  (`UnhelpfulError`) says so, without failing the test.

The mutants derive from SEED (set LILY_FUZZ_SEED to explore others); a failure shows the seed, the
case, the mutation, the command, its exit code and the tail of its stderr. The binary is
`$LILY_BIN` (default target/release/lily).
"""

import json
import math
import os
import random
import resource
import shutil
import struct
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
LILY = os.environ.get("LILY_BIN", str(ROOT / "target" / "release" / "lily"))
FIXTURES = ROOT / "tests" / "fixtures"
SEED = int(os.environ.get("LILY_FUZZ_SEED", "2718"))
TIMEOUT_S = 60
MEMORY_LIMIT = 1 << 30
LILY_ENV = {**os.environ, "RAYON_NUM_THREADS": "2", "RUST_BACKTRACE": "0"}
INDEX = "model.safetensors.index.json"
SOURCES = ["tiny-wrapper", "tiny-text", "tiny-q4"]
BF16_SOURCES = ["tiny-wrapper", "tiny-text"]
# Tensors lily does not read (multi-token prediction, vision): losing them is no error.
UNUSED_PREFIXES = ("mtp.", "model.visual.")
# The commands a mutant runs through, and the set of them that must refuse a broken checkpoint.
BROKEN = frozenset({"logits", "generate", "convert"})


class UnhelpfulError(UserWarning):
    """An error message that does not name what a mutation broke."""


@dataclass
class Mutation:
    """What was done to the copy, which commands must refuse it (exit 1), and what a helpful
    error message mentions (all of `names`)."""

    what: str
    refused_by: frozenset = frozenset()
    names: tuple = ()


def broken(what: str, *names: str) -> Mutation:
    """A mutant that is no valid checkpoint: every command must refuse it."""
    return Mutation(what, BROKEN, names)


def either(what: str) -> Mutation:
    """A mutant that may still be a valid checkpoint: success and a clean error both do."""
    return Mutation(what)


# --- the fixtures and their files ----------------------------------------------------------


@pytest.fixture(scope="session")
def sources(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("sources")
    found = {}
    for name in BF16_SOURCES:
        found[name] = base / name
        shutil.copytree(FIXTURES / name, found[name], ignore=shutil.ignore_patterns("golden.*"))
    found["tiny-q4"] = base / "tiny-q4"
    subprocess.run(
        [LILY, "convert", "--model", found["tiny-wrapper"], "--out", found["tiny-q4"],
         "--bits", "4", "--group-size", "64"],
        check=True, capture_output=True,
    )
    return found


def read_json(path: Path):
    return json.loads(path.read_text())


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=2))


def text_config(config: dict) -> dict:
    """The text model's fields: under `text_config` in the wrapper form, else the file's own."""
    return config.get("text_config", config)


def shard_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def read_safetensors(path: Path) -> tuple[dict, bytes]:
    """The header (in file order) and the data of a safetensors file."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def write_safetensors(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


class Tensor(NamedTuple):
    dtype: str
    shape: list
    data: bytes


def read_tensors(path: Path) -> tuple[dict, dict[str, Tensor]]:
    """The `__metadata__` and the tensors of a safetensors file, in file order."""
    header, data = read_safetensors(path)
    metadata = header.pop("__metadata__", None)
    tensors = {name: Tensor(info["dtype"], info["shape"], data[slice(*info["data_offsets"])])
               for name, info in header.items()}
    return metadata, tensors


def write_tensors(path: Path, metadata: dict | None, tensors: dict[str, Tensor]) -> None:
    header, chunks, offset = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, t in tensors.items():
        header[name] = {"dtype": t.dtype, "shape": t.shape,
                        "data_offsets": [offset, offset + len(t.data)]}
        chunks.append(t.data)
        offset += len(t.data)
    write_safetensors(path, header, b"".join(chunks))


def edit_tensors(directory: Path, edit: Callable[[str, Tensor], Tensor | None]) -> None:
    """Rewrites every shard with `edit` applied to each tensor (None drops it)."""
    for path in shard_files(directory):
        metadata, tensors = read_tensors(path)
        edited = {name: edit(name, t) for name, t in tensors.items()}
        write_tensors(path, metadata, {n: t for n, t in edited.items() if t is not None})


def all_tensors(directory: Path) -> dict[str, tuple[Path, Tensor]]:
    return {name: (path, t) for path in shard_files(directory)
            for name, t in read_tensors(path)[1].items()}


def is_used(name: str) -> bool:
    return not name.startswith(UNUSED_PREFIXES)


DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "I16": 16, "U16": 16,
              "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64,
              "F64": 64}
FLOAT_DTYPES = ("F16", "BF16", "F32")


def element_size(dtype: str) -> int:
    return DTYPE_BITS[dtype] // 8


def rows_resized(t: Tensor, rows: int) -> Tensor:
    """The first `rows` rows of a matrix, or it padded with zero rows."""
    row = t.shape[1] * element_size(t.dtype)
    data = t.data[:rows * row] + bytes(max(0, rows * row - len(t.data)))
    return Tensor(t.dtype, [rows, *t.shape[1:]], data)


def columns_resized(t: Tensor, cols: int) -> Tensor:
    """The first `cols` values of the last axis of every row, or each row padded with zeros."""
    size = element_size(t.dtype)
    old = t.shape[-1] * size
    rows = [t.data[i:i + old] for i in range(0, len(t.data), old)]
    data = b"".join(r[:cols * size] + bytes(max(0, cols * size - old)) for r in rows)
    return Tensor(t.dtype, [*t.shape[:-1], cols], data)


# --- config.json: fields -------------------------------------------------------------------

# The integer fields whose values fix tensor shapes: changing one breaks the checkpoint.
SHAPE_FIELDS = {
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "moe_intermediate_size",
    "shared_expert_intermediate_size",
}
# Fields whose wrong values show as tensors that do not fit (or are missing).
TENSOR_FIELDS = SHAPE_FIELDS | {"num_hidden_layers", "full_attention_interval"}
REQUIRED_INT_FIELDS = SHAPE_FIELDS - {"head_dim"} | {"num_hidden_layers", "num_experts_per_tok"}
OPTIONAL_INT_FIELDS = {"head_dim", "full_attention_interval", "max_position_embeddings"}
FLOAT_FIELDS = {"rms_norm_eps", "rope_parameters.rope_theta",
                "rope_parameters.partial_rotary_factor"}
CONFIG_FIELDS = sorted(REQUIRED_INT_FIELDS | OPTIONAL_INT_FIELDS | FLOAT_FIELDS)
DELETED = object()
# Spellings Python's json cannot write: written in place of a marker string.
RAW_MARKER = "@@raw@@"
CONFIG_VALUES: dict[str, Callable] = {
    "zero": lambda old: 0,
    "minus-one": lambda old: -1,
    "one": lambda old: 1,
    "2^31": lambda old: 2**31,
    "2^62": lambda old: 2**62,
    "1e30": lambda old: 1e30,
    "fraction": lambda old: old + 0.5,
    "string": lambda old: str(old),
    "null": lambda old: None,
    "list": lambda old: [old],
    "true": lambda old: True,
    "plus-2^62": lambda old: old + 2**62,
    "plus-2^63": lambda old: old + 2**63,
    "1e999": lambda old: RAW_MARKER + "1e999",
    "NaN": lambda old: RAW_MARKER + "NaN",
    "deleted": lambda old: DELETED,
}


def write_config(path: Path, config: dict) -> None:
    text = json.dumps(config, indent=2)
    for raw in ("1e999", "NaN"):
        text = text.replace(f'"{RAW_MARKER}{raw}"', raw)
    path.write_text(text)


def field_parent(config: dict, field: str) -> tuple[dict, str]:
    """The object holding `field` (dotted for `rope_parameters.*`) and its last key."""
    parent = text_config(config)
    *outer, key = field.split(".")
    for name in outer:
        parent = parent[name]
    return parent, key


def whole(value) -> bool:
    """Whether `value` reads as an unsigned 64-bit integer (as usize fields want)."""
    return type(value) is int and 0 <= value < 2**64


def field_must_refuse(field: str, old, new, text: dict) -> bool:
    """Whether lily must refuse `field` set to `new` (DELETED: removed)."""
    if isinstance(new, str) and new.startswith(RAW_MARKER):
        return True
    if new is DELETED or new is None:
        return field in REQUIRED_INT_FIELDS
    if field in FLOAT_FIELDS:
        if type(new) not in (int, float):
            return True
        # RoPE needs a positive base and an even share of head_dim; RMSNorm a non-negative
        # epsilon: anything else is no model (and gives NaN or skips RoPE silently).
        if field.endswith("partial_rotary_factor"):
            rotary = int(text["head_dim"] * new)
            return new < 0 or rotary % 2 == 1 or rotary > text["head_dim"]
        return new <= 0 if field.endswith("rope_theta") else new < 0
    if not whole(new):
        return True
    if field == "num_experts_per_tok":
        return not 1 <= new <= text["num_experts"]
    return field in SHAPE_FIELDS and new != old


def config_field_mutation(directory: Path, field: str, value: str) -> Mutation:
    path = directory / "config.json"
    config = read_json(path)
    parent, key = field_parent(config, field)
    old = parent[key]
    new = CONFIG_VALUES[value](old)
    refuse = field_must_refuse(field, old, new, text_config(config))
    if new is DELETED:
        del parent[key]
    else:
        parent[key] = new
    write_config(path, config)
    what = f"config.json: `{field}` {'deleted' if new is DELETED else f'{old!r} -> {new!r}'}"
    if isinstance(new, str) and new.startswith(RAW_MARKER):
        names = ("config.json", "line")
    elif field in TENSOR_FIELDS and (whole(new) or (field in OPTIONAL_INT_FIELDS
                                                    and new in (DELETED, None))):
        names = ()  # a size lily can read: it names the tensor that no longer fits
    else:
        names = (key,)
    return Mutation(what, BROKEN if refuse else frozenset(), names)


# --- config.json: structure, layers, rope, eos, flags --------------------------------------


def config_text(rng: random.Random, directory: Path) -> Mutation:
    path = directory / "config.json"
    text = path.read_text()
    config = json.loads(text)
    wrapper = "text_config" in config
    op = rng.choice(["truncated", "empty", "not-object", "invalid-utf8", "deleted", "deep",
                     "model-type", "form"])
    if op == "truncated":
        cut = rng.randrange(1, len(text) - 1)
        path.write_text(text[:cut])
        return broken(f"config.json truncated to {cut} of {len(text)} characters", "config.json")
    if op == "empty":
        path.write_text("")
        return broken("config.json empty", "config.json")
    if op == "not-object":
        value = rng.choice(["[]", "7", "null", '"qwen3_5_moe"', "true", json.dumps([config])])
        path.write_text(value)
        return broken(f"config.json is {value[:40]}", "config.json")
    if op == "invalid-utf8":
        at = rng.randrange(len(text))
        path.write_bytes(text[:at].encode() + b"\xff\xfe" + text[at:].encode())
        return broken(f"config.json: invalid UTF-8 at byte {at}", "config.json")
    if op == "deleted":
        path.unlink()
        return broken("config.json deleted", "config.json")
    if op == "deep":
        depth = rng.choice([200, 10_000, 1_000_000])
        config["deeply_nested"] = "@@deep@@"
        path.write_text(json.dumps(config).replace('"@@deep@@"', "[" * depth + "]" * depth))
        return either(f"config.json: an unknown key holds arrays nested {depth} deep")
    if op == "model-type":
        where = rng.choice([config, text_config(config)] if wrapper else [config])
        value = rng.choice(["qwen2", "", "QWEN3_5_MOE", "qwen3_5_moe_vl", 7, None, ["qwen3_5_moe"],
                            DELETED])
        if value is DELETED:
            where.pop("model_type")
        else:
            where["model_type"] = value
        write_json(path, config)
        place = "text_config.model_type" if where is not config else "model_type"
        what = f"config.json: `{place}` = {'deleted' if value is DELETED else value!r}"
        # The text model's own `model_type` may be left out.
        if where is not config and value in (DELETED, None):
            return either(what)
        return broken(what, "model_type")
    if wrapper:
        form = rng.choice(["flattened", "labelled-text", "text-config-list", "text-config-null"])
        if form == "flattened":
            config = {**config.pop("text_config"), **config}
        elif form == "labelled-text":
            config["model_type"] = "qwen3_5_moe_text"
        else:
            config["text_config"] = [] if form == "text-config-list" else None
        write_json(path, config)
        return broken(f"config.json: wrapper form {form}", "config.json")
    form = rng.choice(["nested-unlabelled", "wrapped"])
    if form == "wrapped":
        write_json(path, {"model_type": "qwen3_5_moe", "text_config": config})
        return either("config.json: the text-only config put in the wrapper form")
    write_json(path, {"model_type": "qwen3_5_moe_text", "text_config": config})
    return broken("config.json: text-only config nested under `text_config` but labelled "
                  "qwen3_5_moe_text", "config.json")


def layer_plan(text: dict) -> list[str]:
    if "layer_types" in text:
        return list(text["layer_types"])
    interval = text.get("full_attention_interval", 4)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(text["num_hidden_layers"])]


def config_layers(rng: random.Random, directory: Path) -> Mutation:
    path = directory / "config.json"
    config = read_json(path)
    text = text_config(config)
    plan = layer_plan(text)
    op = rng.choice(["length", "unknown", "not-string", "not-list", "swapped", "fewer-layers",
                     "explicit"])
    if op == "length":
        plan = plan[:rng.randrange(len(plan))] if rng.random() < 0.5 else plan + plan[:2]
        mutation = broken(f"config.json: `layer_types` has {len(plan)} entries", "layer_types")
    elif op == "unknown":
        i = rng.randrange(len(plan))
        plan[i] = rng.choice(["mamba", "", "Full_Attention", "sliding_attention"])
        mutation = broken(f"config.json: `layer_types[{i}]` = {plan[i]!r}", "layer_types")
    elif op == "not-string":
        i = rng.randrange(len(plan))
        plan[i] = rng.choice([7, None, [], {"type": "full_attention"}])
        mutation = broken(f"config.json: `layer_types[{i}]` = {plan[i]!r}", "layer_types")
    elif op == "not-list":
        plan = rng.choice(["full_attention", {}, 4, True])
        mutation = broken(f"config.json: `layer_types` = {plan!r}", "layer_types")
    elif op == "swapped":
        i = rng.randrange(len(plan))
        plan[i] = "linear_attention" if plan[i] != "linear_attention" else "full_attention"
        mutation = broken(f"config.json: `layer_types[{i}]` swapped to {plan[i]!r}",
                          f"layers.{i}.")
    elif op == "fewer-layers":
        keep = rng.randrange(1, len(plan))
        plan = plan[:keep]
        text["num_hidden_layers"] = keep
        mutation = either(f"config.json: only the first {keep} layers (`layer_types` to match)")
    else:
        plan = [("attention" if t == "full_attention" and rng.random() < 0.5 else t)
                for t in plan]
        mutation = either(f"config.json: explicit `layer_types` {plan}")
    text["layer_types"] = plan
    write_json(path, config)
    return mutation


def config_rope(rng: random.Random, directory: Path) -> Mutation:
    path = directory / "config.json"
    config = read_json(path)
    text = text_config(config)
    op = rng.choice(["rope-type", "container", "partial", "top-level"])
    if op == "rope-type":
        value = rng.choice(["yarn", "linear", "", 7, None, "DEFAULT"])
        text["rope_parameters"]["rope_type"] = value
        what = f"config.json: `rope_parameters.rope_type` = {value!r}"
        mutation = either(what) if value is None else broken(what, "rope_type")
    elif op == "container":
        value = rng.choice([None, [], "default", 1e6, {}, [10_000.0, 0.25]])
        text["rope_parameters"] = value
        refuse = not (value is None or value == {})
        mutation = Mutation(f"config.json: `rope_parameters` = {value!r}",
                            BROKEN if refuse else frozenset(), ("rope_parameters",))
    elif op == "partial":
        value = rng.choice([2, 1.5, -0.5, 0.3, 1 / text["head_dim"], 0.5, 1, 1e-9])
        text["rope_parameters"]["partial_rotary_factor"] = value
        rotary = max(0, int(text["head_dim"] * value))
        refuse = value < 0 or rotary % 2 == 1 or rotary > text["head_dim"]
        mutation = Mutation(f"config.json: `rope_parameters.partial_rotary_factor` = {value!r}",
                            BROKEN if refuse else frozenset(), ("RoPE",))
    else:
        rope = text.pop("rope_parameters")
        theta = rng.choice([rope["rope_theta"], 0, -1.0, 1e-300])
        text["rope_theta"] = theta
        mutation = Mutation(f"config.json: `rope_parameters` replaced by a top-level "
                            f"`rope_theta` = {theta!r}", BROKEN if theta <= 0 else frozenset(),
                            ("rope_theta",))
    write_json(path, config)
    return mutation


def config_eos(rng: random.Random, directory: Path) -> Mutation:
    path = directory / "config.json"
    config = read_json(path)
    text = text_config(config)
    vocab = text["vocab_size"]
    value = rng.choice([vocab, vocab - 1, -1, 2**32, 2**64, "1000", [1, "x"], [], None, 1.5,
                        [[1]], True, {}, [vocab + 3]])
    text["eos_token_id"] = value
    write_json(path, config)
    fine = value in (vocab - 1, None, [])
    return Mutation(f"config.json: `eos_token_id` = {value!r} (vocabulary {vocab})",
                    frozenset() if fine else BROKEN, ("eos_token_id",))


def config_flags(rng: random.Random, directory: Path) -> Mutation:
    path = directory / "config.json"
    config = read_json(path)
    text = text_config(config)
    fine, convert_refuses = frozenset(), frozenset({"convert"})
    field, value, refused_by = rng.choice([
        ("attention_bias", True, BROKEN), ("attention_bias", "true", BROKEN),
        ("attention_bias", False, fine), ("attn_output_gate", False, BROKEN),
        ("attn_output_gate", 0, BROKEN), ("hidden_act", "gelu", BROKEN),
        ("hidden_act", None, fine), ("hidden_act", 7, BROKEN), ("tie_word_embeddings", True, fine),
        ("tie_word_embeddings", "yes", BROKEN), ("tie_word_embeddings", None, fine),
        ("dtype", "float16", fine), ("dtype", "float32", fine), ("dtype", "int8", fine),
        ("dtype", 7, fine), ("torch_dtype", "float16", fine), ("torch_dtype", [], fine),
        # Dense weights under a quantization block run; convert will not requantise them.
        ("quantization", {"group_size": 64, "bits": 4, "mode": "affine"}, convert_refuses),
    ])
    (config if field in ("torch_dtype", "quantization") else text)[field] = value
    write_json(path, config)
    return Mutation(f"config.json: `{field}` = {value!r}", refused_by, (field,))


# --- config.json: the quantization block ---------------------------------------------------


def quantization(rng: random.Random, directory: Path) -> Mutation:
    path = directory / "config.json"
    config = read_json(path)
    block = config["quantization"]
    gate = "language_model.model.layers.1.mlp.gate"
    op = rng.choice(["bits", "group_size", "mode", "missing-module", "override-bits",
                     "override-bad", "override-false", "override-true", "override-junk",
                     "not-object", "removed", "quant-method", "empty"])
    refuse, names = True, ("quantization",)
    if op in ("bits", "group_size", "mode"):
        choices = {"bits": [0, 2, 3, 5, 8, 16, -4, "4", 4.0, None, 2**62],
                   "group_size": [0, 16, 32, 128, 256, 2**62, -64, "64", 64.0, None],
                   "mode": ["mxfp4", "", None, 7, "AFFINE"]}[op]
        value = rng.choice(choices)
        block[op] = value
        # The global setting is only a default: each module's own tensors fix how it is stored.
        refuse = value not in {"bits": (4, 8, None), "group_size": (32, 64, 128, None),
                               "mode": (None,)}[op] or isinstance(value, float)
        what, names = f"`quantization.{op}` = {value!r}", (f"quantization.{op}",)
    elif op == "missing-module":
        block["language_model.model.layers.99.mlp.gate"] = {"bits": 8, "group_size": 64}
        what, refuse = "an override for a module that does not exist", False
    elif op == "override-bits":
        block[gate] = {"bits": 4, "group_size": 64}
        what, names = f"override `{gate}` says 4-bit (stored at 8)", (gate,)
    elif op == "override-bad":
        block[gate] = rng.choice([{"bits": 3}, {"group_size": 48}, {"mode": "nf4"},
                                  {"bits": "8"}])
        what, names = f"override `{gate}` = {block[gate]}", (gate,)
    elif op == "override-false":
        block[gate] = False
        what, names = f"override `{gate}` = false (it is quantised)", (gate,)
    elif op == "override-true":
        block[gate] = True
        what, names = f"override `{gate}` = true (the 4-bit default; stored at 8)", (gate,)
    elif op == "override-junk":
        block[gate] = rng.choice(["8bit", 8, [8, 64], None])
        what, refuse = f"override `{gate}` = {block[gate]!r} (not an entry)", False
    elif op == "not-object":
        config["quantization"] = rng.choice([[], "affine", 4, True])
        what = f"`quantization` = {config['quantization']!r}"
    elif op == "removed":
        del config["quantization"], config["quantization_config"]
        what, names = "the `quantization` block removed (scales remain)", (".scales",)
    elif op == "quant-method":
        del config["quantization"]
        config["quantization_config"] = {"quant_method": rng.choice(["gptq", "awq", "fp8"]),
                                         "bits": 4}
        what, names = "`quantization_config` from another method", ("quant_method",)
    else:
        config["quantization"] = {}
        what, refuse = "`quantization` = {} (MLX defaults; modules by their tensors)", False
    write_json(path, config)
    return Mutation(f"config.json: {what}", BROKEN if refuse else frozenset(),
                    names if refuse else ())


# --- safetensors files ---------------------------------------------------------------------


def pick_file(rng: random.Random, directory: Path) -> Path:
    return rng.choice(shard_files(directory))


def pick_used_tensor(rng: random.Random, directory: Path) -> tuple[str, Path, Tensor]:
    found = all_tensors(directory)
    name = rng.choice(sorted(n for n in found if is_used(n)))
    return (name, *found[name])


def header_length(rng: random.Random, directory: Path) -> Mutation:
    path = pick_file(rng, directory)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    value = rng.choice([0, 1, 7, length - 1, length + 1, length + 8, len(raw), 2**32, 2**63,
                        2**64 - 1, 100_000_000, 100_000_001])
    path.write_bytes(struct.pack("<Q", value) + raw[8:])
    return broken(f"{path.name}: header length {length} -> {value}", path.name)


def header_field(rng: random.Random, directory: Path) -> Mutation:
    path = pick_file(rng, directory)
    header, data = read_safetensors(path)
    names = [n for n in header if n != "__metadata__"]
    name = rng.choice(names)
    info = header[name]
    used = is_used(name)
    op = rng.choice(["dtype-unknown", "dtype-size", "dtype-same-size", "shape", "shape-kept-size",
                     "offsets", "offsets-swapped", "metadata", "padding"])
    if op == "dtype-unknown":
        info["dtype"] = rng.choice(["Q4", "", "bf16", "FLOAT", 7, None])
        mutation = broken(f"{path.name}: `{name}` dtype {info['dtype']!r}", path.name)
    elif op == "dtype-size":
        bits = DTYPE_BITS[info["dtype"]]
        info["dtype"] = rng.choice(sorted(d for d, b in DTYPE_BITS.items() if b != bits))
        mutation = broken(f"{path.name}: `{name}` dtype {info['dtype']} (another size)",
                          name, path.name)
    elif op == "dtype-same-size":
        bits = DTYPE_BITS[info["dtype"]]
        old = info["dtype"]
        info["dtype"] = rng.choice(sorted(d for d, b in DTYPE_BITS.items()
                                          if b == bits and d != old))
        # Another float type of the same size reads as other values; anything else is refused.
        fine = not used or {old, info["dtype"]} <= set(FLOAT_DTYPES)
        mutation = Mutation(f"{path.name}: `{name}` dtype {old} -> {info['dtype']}",
                            frozenset() if fine else BROKEN, (name, path.name))
    elif op == "shape":
        shape = list(info["shape"])
        change = rng.choice(["plus-one", "minus-one", "negative", "huge", "extra-axis", "scalar"])
        if change == "scalar" or not shape:
            shape = []
        elif change == "extra-axis":
            shape = [1, *shape]
        else:
            i = rng.randrange(len(shape))
            shape[i] = {"plus-one": shape[i] + 1, "minus-one": shape[i] - 1, "negative": -1,
                        "huge": 2**62}[change]
        refuse = used or change != "extra-axis"
        mutation = Mutation(f"{path.name}: `{name}` shape {info['shape']} -> {shape}",
                            BROKEN if refuse and shape != info["shape"] else frozenset(),
                            (name, path.name))
        info["shape"] = shape
    elif op == "shape-kept-size":
        shape = info["shape"]
        count = 1
        for d in shape:
            count *= d
        new = rng.choice([[count], list(reversed(shape)), [count // 2, 2] if count % 2 == 0
                          else [count], [*shape, 1]])
        mutation = Mutation(f"{path.name}: `{name}` shape {shape} -> {new} (same size)",
                            BROKEN if used and new != shape else frozenset(), (name, path.name))
        info["shape"] = new
    elif op == "offsets":
        begin, end = info["data_offsets"]
        new = rng.choice([[begin - 2, end], [begin, end + 2], [end, begin], [begin, len(data) + 8],
                          [begin + 1, end + 1], [0, end - begin], [-1, end], [begin, 2**64 - 1]])
        info["data_offsets"] = new
        mutation = broken(f"{path.name}: `{name}` data_offsets {[begin, end]} -> {new}",
                          path.name)
    elif op == "offsets-swapped":
        same = [n for n in names if n != name and header[n]["dtype"] == info["dtype"]
                and header[n]["shape"] == info["shape"]]
        if not same:
            info["data_offsets"] = [0, 0]
            mutation = broken(f"{path.name}: `{name}` data_offsets [0, 0]", path.name)
        else:
            other = header[rng.choice(same)]
            info["data_offsets"], other["data_offsets"] = (other["data_offsets"],
                                                           info["data_offsets"])
            mutation = either(f"{path.name}: `{name}` swaps its bytes with a tensor of its shape")
    elif op == "metadata":
        header["__metadata__"] = rng.choice([{"format": 7}, [], "pt", None, {"format": None}])
        mutation = Mutation(f"{path.name}: `__metadata__` = {header['__metadata__']!r}",
                            frozenset() if header["__metadata__"] is None else BROKEN,
                            (path.name,))
    else:
        text = json.dumps(header, separators=(",", ":")).encode()
        pad = rng.choice([b" " * 8, b"\n\t  ", b"\x00" * 8])
        path.write_bytes(struct.pack("<Q", len(text) + len(pad)) + text + pad + data)
        return Mutation(f"{path.name}: header padded with {pad!r}",
                        BROKEN if b"\x00" in pad else frozenset(), (path.name,))
    write_safetensors(path, header, data)
    return mutation


def truncated(rng: random.Random, directory: Path) -> Mutation:
    path = pick_file(rng, directory)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    where = rng.choice(["prefix", "header", "data", "last-byte", "extended", "empty"])
    if where == "extended":
        extra = rng.randbytes(rng.randrange(1, 100))
        path.write_bytes(raw + extra)
        return broken(f"{path.name}: {len(extra)} bytes appended", path.name)
    cut = {"prefix": rng.randrange(0, 8), "header": rng.randrange(8, 8 + length),
           "data": rng.randrange(8 + length, len(raw)), "last-byte": len(raw) - 1,
           "empty": 0}[where]
    path.write_bytes(raw[:cut])
    return broken(f"{path.name}: truncated to {cut} of {len(raw)} bytes ({where})", path.name)


HEADER_BYTES = b'0123456789"{}[],:.-+eE _ABFIU'


def header_bytes(rng: random.Random, directory: Path) -> Mutation:
    path = pick_file(rng, directory)
    raw = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    flips = []
    for _ in range(rng.randrange(1, 5)):
        at = rng.randrange(8, 8 + length)
        # Mostly bytes that keep the header UTF-8 and may keep it JSON.
        raw[at] = rng.choice(HEADER_BYTES) if rng.random() < 0.8 else rng.randrange(256)
        flips.append((at, bytes([raw[at]])))
    path.write_bytes(bytes(raw))
    # A changed byte may leave a valid header (another name, digit or dtype): either outcome.
    return either(f"{path.name}: header bytes set (offset, value) {flips}")


def tensor_set(rng: random.Random, directory: Path) -> Mutation:
    name, path, t = pick_used_tensor(rng, directory)
    metadata, tensors = read_tensors(path)
    op = rng.choice(["deleted", "renamed", "extra", "duplicated", "moved"])
    index_path = directory / INDEX
    index = read_json(index_path) if index_path.exists() else None
    if op == "deleted":
        del tensors[name]
        mutation = broken(f"{path.name}: `{name}` deleted", name)
    elif op == "renamed":
        new = rng.choice([name + "_", name.upper(), name.replace(".", "/"), name[:-1], " " + name])
        tensors = {(new if n == name else n): v for n, v in tensors.items()}
        mutation = broken(f"{path.name}: `{name}` renamed `{new}`", name)
    elif op == "extra":
        extra = rng.choice([n for n in ["model.extra.weight", name + ".extra", "",
                                        "language_model.lm_head",
                                        name.removesuffix(".weight") + ".scales"]
                            if n not in tensors])
        tensors[extra] = Tensor("F32", [3], bytes(12))
        mutation = either(f"{path.name}: extra tensor `{extra}`")
    else:
        shard = directory / "model-extra.safetensors"
        write_tensors(shard, None, {name: t})
        if op == "moved":
            del tensors[name]
        if index is not None:
            index["weight_map"][name] = shard.name
            write_json(index_path, index)
        mutation = (either(f"`{name}` moved into a new shard {shard.name}") if op == "moved"
                    else broken(f"`{name}` also in a new shard {shard.name}", name))
    write_tensors(path, metadata, tensors)
    return mutation


# --- quantised tensors (tiny-q4) -----------------------------------------------------------


def quantised_module(rng: random.Random, directory: Path) -> tuple[str, dict, Path]:
    """A random quantised module: its path, its weight, scales and biases, and their file."""
    found = all_tensors(directory)
    module = rng.choice(sorted(n[:-len(".scales")] for n in found if n.endswith(".scales")))
    path = found[module + ".weight"][0]
    return module, {part: found[f"{module}.{part}"][1] for part in
                    ("weight", "scales", "biases")}, path


def regrouped(t: Tensor, groups: int) -> Tensor:
    """Scales or biases with each value stated twice (`groups` twice as many: half the group
    size, the same values) or every other one dropped (twice the group size)."""
    size, old = element_size(t.dtype), t.shape[-1]
    rows = []
    for start in range(0, len(t.data), old * size):
        values = [t.data[start + i * size:start + (i + 1) * size] for i in range(old)]
        values = [v for v in values for _ in range(2)] if groups > old else values[::2]
        rows.append(b"".join(values))
    return Tensor(t.dtype, [*t.shape[:-1], groups], b"".join(rows))


def quantised_tensors(rng: random.Random, directory: Path) -> Mutation:
    module, parts, path = quantised_module(rng, directory)
    overridden = module in read_json(directory / "config.json")["quantization"]
    words, scales, biases = parts["weight"], parts["scales"], parts["biases"]
    op = rng.choice(["groups-halved", "groups-doubled", "scales-only", "words-shape",
                     "words-dtype", "scales-dtype", "both-dtype", "part-deleted", "dense"])
    edits: dict[str, Tensor | None] = {}
    if op in ("groups-halved", "groups-doubled", "scales-only"):
        groups = scales.shape[-1] // 2 if op == "groups-halved" else scales.shape[-1] * 2
        edits["scales"] = regrouped(scales, groups)
        if op != "scales-only":
            edits["biases"] = regrouped(biases, groups)
        # tiny-q4 has groups of 64 throughout; an override in config.json pins its module's.
        group = scales.shape[-1] * 64 // groups if groups else 0
        fine = op != "scales-only" and group in (32, 64, 128) and not overridden
        what = "scales" if op == "scales-only" else "scales and biases"
        mutation = Mutation(f"{path.name}: `{module}` {what} regrouped to {groups} per row",
                            frozenset() if fine else BROKEN, (module,))
    elif op == "dense":
        # tiny-q4 has groups of 64 throughout: this many inputs per row.
        cols = scales.shape[-1] * 64
        count = len(scales.data) // element_size(scales.dtype) * 64
        edits = {"weight": Tensor("BF16", [*words.shape[:-1], cols], bytes(2 * count)),
                 "scales": None, "biases": None}
        # Dense is a fine way to store a module, unless config.json says it is quantised.
        mutation = Mutation(f"{path.name}: `{module}` stored dense (zeros)",
                            BROKEN if overridden else frozenset(), (module,))
    elif op == "words-shape":
        rows, per_row = words.shape[-2], words.shape[-1]
        edits["weight"] = Tensor(words.dtype, [*words.shape[:-2], rows // 2, per_row * 2],
                                 words.data)
        mutation = broken(f"{path.name}: `{module}.weight` rows halved, words per row doubled",
                          f"{module}.weight")
    elif op == "words-dtype":
        dtype = rng.choice(["I32", "F32"])
        edits["weight"] = Tensor(dtype, words.shape, words.data)
        mutation = broken(f"{path.name}: `{module}.weight` dtype {dtype}", f"{module}.weight")
    elif op == "scales-dtype":
        edits["scales"] = Tensor("F16", scales.shape, scales.data)
        mutation = broken(f"{path.name}: `{module}.scales` F16 but its biases BF16", module)
    elif op == "both-dtype":
        edits["scales"] = Tensor("F16", scales.shape, scales.data)
        edits["biases"] = Tensor("F16", biases.shape, biases.data)
        mutation = either(f"{path.name}: `{module}` scales and biases reread as F16")
    else:
        part = rng.choice(["weight", "scales", "biases"])
        edits[part] = None
        mutation = broken(f"{path.name}: `{module}.{part}` deleted", f"{module}.{part}")
    metadata, tensors = read_tensors(path)
    for part, t in edits.items():
        tensors[f"{module}.{part}"] = t
    write_tensors(path, metadata, {n: t for n, t in tensors.items() if t is not None})
    return mutation


# --- the shard index -----------------------------------------------------------------------


def index(rng: random.Random, directory: Path) -> Mutation:
    path = directory / INDEX
    text = path.read_text()
    contents = json.loads(text)
    weight_map = contents["weight_map"]
    tensor = rng.choice(sorted(weight_map))
    shards = sorted(set(weight_map.values()))
    op = rng.choice(["truncated", "empty", "not-object", "weight-map", "entry-type",
                     "missing-shard", "path", "not-safetensors", "wrong-shard", "shard-dropped",
                     "index-deleted", "shard-deleted", "shard-directory", "metadata"])
    if op == "truncated":
        cut = rng.randrange(1, len(text) - 1)
        path.write_text(text[:cut])
        return broken(f"{INDEX} truncated to {cut} of {len(text)} characters", INDEX)
    if op == "empty":
        path.write_text("")
        return broken(f"{INDEX} empty", INDEX)
    if op == "index-deleted":
        path.unlink()
        return either(f"{INDEX} deleted (every *.safetensors file is read)")
    if op == "shard-deleted":
        shard = rng.choice(shards)
        (directory / shard).unlink()
        return broken(f"shard {shard} deleted", shard)
    if op == "shard-directory":
        shard = rng.choice(shards)
        (directory / shard).unlink()
        (directory / shard).mkdir()
        return broken(f"shard {shard} replaced by a directory", shard)
    if op == "not-object":
        contents = rng.choice([[], "x", 7, None])
        mutation = broken(f"{INDEX} is {contents!r}", INDEX)
    elif op == "weight-map":
        replaced = rng.choice([[], "x", 7, None, DELETED])
        if replaced is DELETED:
            del contents["weight_map"]
        else:
            contents["weight_map"] = replaced
        mutation = broken(f"{INDEX}: `weight_map` "
                          f"{'deleted' if replaced is DELETED else f'= {replaced!r}'}",
                          INDEX, "weight_map")
    elif op == "entry-type":
        weight_map[tensor] = rng.choice([7, None, [], {"file": shards[0]}])
        mutation = broken(f"{INDEX}: entry for `{tensor}` = {weight_map[tensor]!r}", INDEX,
                          tensor)
    elif op == "missing-shard":
        weight_map[tensor] = "model-00009-of-00009.safetensors"
        mutation = broken(f"{INDEX}: `{tensor}` in a shard that does not exist",
                          "model-00009-of-00009.safetensors")
    elif op == "path":
        weight_map[tensor] = rng.choice(["../" + shards[0], "sub/" + shards[0], "/etc/passwd",
                                         ".", "..", "", "a\\b"])
        mutation = broken(f"{INDEX}: `{tensor}` in {weight_map[tensor]!r}", INDEX)
    elif op == "not-safetensors":
        weight_map[tensor] = rng.choice(["config.json", INDEX])
        mutation = broken(f"{INDEX}: `{tensor}` in {weight_map[tensor]}", weight_map[tensor])
    elif op == "wrong-shard":
        # lily reads every listed shard whole, so only the set of shards matters.
        weight_map[tensor] = rng.choice(shards)
        mutation = either(f"{INDEX}: `{tensor}` listed in {weight_map[tensor]}")
    elif op == "shard-dropped":
        dropped = rng.choice(shards)
        contents["weight_map"] = {t: s for t, s in weight_map.items() if s != dropped}
        mutation = broken(f"{INDEX}: no tensor listed in {dropped}")
    else:
        contents["metadata"] = rng.choice([{"total_size": "x"}, [], None, {"total_size": -1}])
        mutation = either(f"{INDEX}: `metadata` = {contents['metadata']!r}")
    write_json(path, contents)
    return mutation


# --- generation_config.json ----------------------------------------------------------------


def generation_config(rng: random.Random, directory: Path) -> Mutation:
    path = directory / "generation_config.json"
    vocab = text_config(read_json(directory / "config.json"))["vocab_size"]
    op = rng.choice(["eos", "eos", "eos", "truncated", "not-object", "deleted"])
    if op == "truncated":
        path.write_text(path.read_text()[:5])
        return Mutation("generation_config.json truncated", frozenset({"generate", "convert"}),
                        ("generation_config.json",))
    if op == "not-object":
        path.write_text(rng.choice(["[]", "7", "null"]))
        return either("generation_config.json is not an object")
    if op == "deleted":
        path.unlink()
        return either("generation_config.json deleted")
    value = rng.choice([vocab + 5, vocab - 1, -1, "x", [1, "y"], None, [], 2**40, True, 1.5])
    write_json(path, {"eos_token_id": value, "do_sample": False})
    fine = value is not True and value in (vocab + 5, vocab - 1, None, [])
    return Mutation(f"generation_config.json: `eos_token_id` = {value!r} (vocabulary {vocab})",
                    frozenset() if fine else frozenset({"generate"}),
                    ("generation_config.json", "eos_token_id"))


# --- consistent edits: unusual but valid checkpoints ---------------------------------------


def shared_expert_width(rng: random.Random, directory: Path) -> Mutation:
    """`shared_expert_intermediate_size` changed, with the shared experts' weights cut or padded
    with zeros to match (padding leaves the model's function as it was)."""
    path = directory / "config.json"
    config = read_json(path)
    text = text_config(config)
    old = text["shared_expert_intermediate_size"]
    width = rng.choice([0, 1, 3, old // 2, old + 32])
    text["shared_expert_intermediate_size"] = width
    write_json(path, config)

    def edit(name: str, t: Tensor) -> Tensor:
        if ".mlp.shared_expert." not in name or not is_used(name):
            return t
        return columns_resized(t, width) if "down_proj" in name else rows_resized(t, width)

    edit_tensors(directory, edit)
    return either(f"shared experts {old} -> {width} wide (config and tensors)")


def conv_kernel(rng: random.Random, directory: Path) -> Mutation:
    """`linear_conv_kernel_dim` changed, with each conv1d channel's taps cut to the last ones or
    padded with leading zeros."""
    path = directory / "config.json"
    config = read_json(path)
    text = text_config(config)
    old = text["linear_conv_kernel_dim"]
    kernel = rng.choice([1, 2, 3, old + 2])
    text["linear_conv_kernel_dim"] = kernel
    write_json(path, config)

    def edit(name: str, t: Tensor) -> Tensor:
        if not name.endswith("conv1d.weight") or not is_used(name):
            return t
        size = element_size(t.dtype)
        channels = [t.data[i:i + old * size] for i in range(0, len(t.data), old * size)]
        taps = b"".join(bytes(max(0, kernel - old) * size) + c[max(0, old - kernel) * size:]
                        for c in channels)
        # Hugging Face stores [channels, 1, kernel], MLX-LM [channels, kernel, 1].
        shape = [t.shape[0], 1, kernel] if t.shape[1] == 1 else [t.shape[0], kernel, 1]
        return Tensor(t.dtype, shape, taps)

    edit_tensors(directory, edit)
    return either(f"convolution kernel {old} -> {kernel} taps (config and tensors)")


# --- running lily and checking what it did -------------------------------------------------


class Run(NamedTuple):
    command: str
    args: list
    code: int | None  # None: still running at the time limit (killed)
    stdout: str
    stderr: str


def limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run_lily(cwd: Path, *args) -> Run:
    """Runs lily in `cwd` (paths relative to it keep messages short)."""
    args = [str(a) for a in args]
    try:
        done = subprocess.run([LILY, *args], cwd=cwd, capture_output=True, text=True,
                              errors="replace", timeout=TIMEOUT_S, preexec_fn=limit_memory,
                              env=LILY_ENV)
    except subprocess.TimeoutExpired as e:
        return Run(args[0], args, None, "", (e.stderr or b"").decode(errors="replace"))
    return Run(args[0], args, done.returncode, done.stdout, done.stderr)


def fail(problem: str, run: Run, context: str) -> None:
    tail = run.stderr[-1500:].strip() or "(empty)"
    pytest.fail(f"{problem}\n  {context}\n  command: lily {' '.join(run.args)}\n"
                f"  exit code: {run.code}\n  stderr (tail): {tail}", pytrace=False)


def check_exit(run: Run, mutation: Mutation, context: str) -> str | None:
    """Exit 0, or 1 with a one-line `error: ...` (returned); 1 where the mutant is broken; never
    a crash."""
    if run.code is None:
        fail(f"no exit within {TIMEOUT_S} s", run, context)
    if run.code < 0:
        fail(f"killed by signal {-run.code}", run, context)
    if run.code == 101 or "panicked" in run.stderr:
        fail("panic", run, context)
    if run.code not in (0, 1):
        fail(f"exit code {run.code}", run, context)
    if run.code == 0:
        if run.command in mutation.refused_by:
            fail("accepted a checkpoint it must refuse", run, context)
        return None
    lines = run.stderr.strip().splitlines()
    if len(lines) != 1 or not lines[0].startswith("error: ") or len(lines[0]) > 2000:
        fail("exit 1 without a one-line `error: ...` on stderr", run, context)
    return lines[0]


def warn_if_unhelpful(errors: list[str], mutation: Mutation, context: str) -> None:
    """Warns (once per mutant) about an error that does not name what the mutation broke."""
    for error in errors:
        missing = [name for name in mutation.names if name not in error]
        if missing:
            warnings.warn(UnhelpfulError(f"{context}: {error!r} does not name {missing}"))
            return


def check_logits(run: Run, context: str) -> None:
    rows = json.loads(run.stdout)["logits"]
    if len(rows) != 3 or len({len(r) for r in rows}) != 1 or not rows[0]:
        fail(f"logits of shape {[len(r) for r in rows]} for 3 prompt tokens", run, context)
    if not all(isinstance(v, float) and math.isfinite(v) for row in rows for v in row):
        fail("accepted the checkpoint but gave non-finite logits (null in the JSON)", run, context)


def check_generation(run: Run, context: str) -> None:
    result = json.loads(run.stdout)
    if not (1 <= len(result["ids"]) <= 2 and result["finish_reason"] in ("stop", "length")):
        fail(f"generation {result} for --max-tokens 2", run, context)


def check_convert(directory: Path, mutation: Mutation, context: str) -> str | None:
    """Converting the mutant: an error (returned) leaves nothing behind; a result runs."""
    where, out = directory.parent, "converted"
    run = run_lily(where, "convert", "--model", directory.name, "--out", out, "--bits", 4,
                   "--group-size", 64)
    error = check_exit(run, mutation, context)
    staging = [p.name for p in where.iterdir() if p.name.startswith(f".{out}.")]
    if staging or (run.code != 0 and (where / out).exists()):
        fail(f"left {staging or [out]} behind", run, context)
    if run.code == 0:
        converted = run_lily(where, "logits", "--model", out, "--prompt-ids", "1,2,3")
        if converted.code != 0:
            fail("the converted checkpoint does not run", converted, context)
        check_logits(converted, f"{context} (converted)")
    return error


def check_mutant(directory: Path, source: str, mutation: Mutation, case: str) -> None:
    context = f"LILY_FUZZ_SEED={SEED} {case} on {source}: {mutation.what}"
    where, model = directory.parent, directory.name
    logits = run_lily(where, "logits", "--model", model, "--prompt-ids", "1,2,3")
    errors = [check_exit(logits, mutation, context)]
    if logits.code == 0:
        generate = run_lily(where, "generate", "--model", model, "--prompt-ids", "1,2",
                            "--max-tokens", 2, "--json")
        errors.append(check_exit(generate, mutation, context))
        check_logits(logits, context)
        if generate.code == 0:
            check_generation(generate, context)
    if source in BF16_SOURCES:
        errors.append(check_convert(directory, mutation, context))
    warn_if_unhelpful([e for e in errors if e], mutation, context)


def copy_source(sources: dict[str, Path], source: str, tmp_path: Path) -> Path:
    directory = tmp_path / source
    shutil.copytree(sources[source], directory)
    return directory


# --- the tests -----------------------------------------------------------------------------


def has_field(directory: Path, field: str) -> bool:
    parent, key = field_parent(read_json(directory / "config.json"), field)
    return key in parent


@pytest.mark.parametrize("value", CONFIG_VALUES)
@pytest.mark.parametrize("field", CONFIG_FIELDS)
def test_config_field(field, value, sources, tmp_path):
    rng = random.Random(f"{SEED}/{field}/{value}")
    source = rng.choice([s for s in SOURCES if has_field(sources[s], field)])
    directory = copy_source(sources, source, tmp_path)
    mutation = config_field_mutation(directory, field, value)
    check_mutant(directory, source, mutation, f"config field {field}={value}")


# Each kind of random mutation: the fixtures it applies to and how many mutants it makes.
RANDOM_KINDS = {
    config_text: (SOURCES, 30),
    config_layers: (SOURCES, 16),
    config_rope: (SOURCES, 16),
    config_eos: (SOURCES, 12),
    config_flags: (SOURCES, 20),
    quantization: (["tiny-q4"], 26),
    header_length: (SOURCES, 12),
    header_field: (SOURCES, 60),
    truncated: (SOURCES, 16),
    header_bytes: (SOURCES, 40),
    tensor_set: (SOURCES, 30),
    quantised_tensors: (["tiny-q4"], 30),
    index: (["tiny-wrapper", "tiny-q4"], 30),
    generation_config: (SOURCES, 12),
    shared_expert_width: (BF16_SOURCES, 10),
    conv_kernel: (SOURCES, 8),
}


@pytest.mark.parametrize(("kind", "number"), [
    pytest.param(kind, n, id=f"{kind.__name__}-{n}")
    for kind, (_, count) in RANDOM_KINDS.items() for n in range(count)
])
def test_random_mutant(kind, number, sources, tmp_path):
    rng = random.Random(f"{SEED}/{kind.__name__}/{number}")
    source = rng.choice(RANDOM_KINDS[kind][0])
    directory = copy_source(sources, source, tmp_path)
    mutation = kind(rng, directory)
    check_mutant(directory, source, mutation, f"{kind.__name__} #{number}")

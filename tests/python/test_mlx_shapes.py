"""lily against MLX-LM on tiny models of randomly drawn shapes.

The fixtures have one layout each; this draws several (seeded, so reproducible) configurations
across what the architecture allows, so that lily's handling of other shapes is checked too:
hidden 64-256; 2-6 layers with full attention every 1-4 layers (so also models with full
attention only, or with DeltaNet only); 1-4 KV heads shared by 1, 2 or 4 query heads of
head_dim 32/64/128; RoPE over 1/4, 1/2 or all of a head, theta 1e4 to 1e7; DeltaNet with 1, 2 or
4 value heads per key head, key and value head dims 32/64/128 (not necessarily equal) and a
convolution of 2-4 taps; 4-32 experts of which 1-8 are routed, expert and shared-expert widths
that differ; RMSNorm eps 1e-6 or 1e-5; tied and untied lm_head; both `config.json` forms (the
`qwen3_5_moe` wrapper with `text_config`, and the flat `qwen3_5_moe_text`), with or without
`layer_types`; weights stored in float32, bfloat16 or float16, and each model again
quantised as MLX-LM's converter does (4 or 8 bits, group size 32, 64 or 128, routers at 8 bits;
matrices whose inputs the group size does not divide stay dense).

Each model is built in MLX-LM from its configuration, given random weights (the RMSNorm and
gated-norm scales, A_log, dt_bias, the convolution and the embedding too, so that no
parameter's handling goes unchecked), and saved as MLX-LM saves a checkpoint. lily's logits at
every position of random prompts, by the prefill path and by the decode path, must match MLX-LM's
float32 forward on the same weights within 1e-4 relative (max |difference| over max |logit|).
One prompt per model is longer than lily's 64-token DeltaNet prefill chunk.

The tolerance is tighter than test_mlx.py's 1e-3 because here nothing but float32 rounding
separates the two sides (same weights, both computing in float32): the differences measured are
about 1e-6 at most. Scaling one parameter family of one of these models by 1 + 5% noise moved
its logits by 1.4e-4 at least (the router of a top-1 model aside: its weights only choose the
expert), and by less than 1e-3 for A_log, in_proj_a, in_proj_b or the shared-expert gate on some
model: 1e-4 catches all of these, a hundredfold above the rounding.

The binary is `$LILY_BIN` (default target/release/lily).
"""

import copy
import json
import os
import random
import subprocess
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map_with_path
from mlx_lm.models.qwen3_5_moe import Model, ModelArgs
from mlx_lm.utils import quantize_model, save_config, save_model

ROOT = Path(__file__).resolve().parents[2]
LILY = os.environ.get("LILY_BIN", str(ROOT / "target" / "release" / "lily"))
TOLERANCE = 1e-4
# Chosen among the first 1000 seeds so that, together, the six draw every value draw_config offers
# at least once, including models with full attention only and with DeltaNet only.
SEEDS = (0, 3, 24, 131, 400, 417)


def draw_config(seed: int) -> SimpleNamespace:
    """A random configuration: `config.json`'s contents, how to store and quantise the weights,
    and the prompts to run."""
    rng = random.Random(seed)
    hidden = rng.choice([64, 128, 192, 256])
    interval = rng.randint(1, 4)
    layers = rng.randint(2, 6)
    kv_heads = rng.choice([1, 2, 4])
    key_heads = rng.choice([1, 2, 4])
    experts = rng.choice([4, 8, 16, 32])
    tie = rng.random() < 0.3
    text = {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": rng.randint(200, 600),
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "full_attention_interval": interval,
        "num_attention_heads": kv_heads * rng.choice([1, 2, 4]),
        "num_key_value_heads": kv_heads,
        "head_dim": rng.choice([32, 64, 128]),
        "attn_output_gate": True,
        # MLX-LM reads RoPE only from `rope_parameters` (flat keys would be overridden by its
        # defaults), so every configuration has the block.
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": rng.choice([1e4, 1e6, 1e7]),
            "partial_rotary_factor": rng.choice([0.25, 0.5, 1.0]),
        },
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": key_heads * rng.choice([1, 2, 4]),
        "linear_key_head_dim": rng.choice([32, 64, 128]),
        "linear_value_head_dim": rng.choice([32, 64, 128]),
        "linear_conv_kernel_dim": rng.randint(2, 4),
        "num_experts": experts,
        "num_experts_per_tok": min(rng.choice([1, 2, 3, 4, 8]), experts),
        "moe_intermediate_size": rng.choice([64, 128, 192]),
        "shared_expert_intermediate_size": rng.choice([64, 128, 256]),
        "hidden_act": "silu",
        "rms_norm_eps": rng.choice([1e-6, 1e-5]),
        "tie_word_embeddings": tie,
        "max_position_embeddings": 4096,
    }
    text["eos_token_id"] = text["vocab_size"] - 1
    if rng.random() < 0.5:
        # The official configs spell the plan out too; MLX-LM reads only the interval.
        text["layer_types"] = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ]
    if rng.random() < 0.5:
        config = {"model_type": "qwen3_5_moe", "tie_word_embeddings": tie, "text_config": text}
    else:
        config = text
    return SimpleNamespace(
        config=config,
        text=text,
        dtype=rng.choice([mx.float32, mx.bfloat16, mx.float16]),
        bits=rng.choice([4, 8]),
        group_size=rng.choice([g for g in (32, 64, 128) if hidden % g == 0]),
        prompts=[
            [rng.randrange(text["vocab_size"]) for _ in range(n)]
            for n in (rng.randint(5, 20), rng.randint(5, 20), rng.randint(65, 80))
        ],
    )


def describe(drawn: SimpleNamespace) -> str:
    t = drawn.text
    return (
        f"h{t['hidden_size']} L{t['num_hidden_layers']}/{t['full_attention_interval']} "
        f"attn {t['num_attention_heads']}q{t['num_key_value_heads']}kv x{t['head_dim']} "
        f"rope {t['rope_parameters']['partial_rotary_factor']} "
        f"gdn {t['linear_num_key_heads']}k{t['linear_num_value_heads']}v "
        f"x{t['linear_key_head_dim']}/{t['linear_value_head_dim']} "
        f"conv{t['linear_conv_kernel_dim']} "
        f"moe {t['num_experts_per_tok']}/{t['num_experts']} "
        f"x{t['moe_intermediate_size']}+{t['shared_expert_intermediate_size']} "
        f"vocab {t['vocab_size']}{' tied' if t['tie_word_embeddings'] else ''} "
        f"{'wrapper' if 'text_config' in drawn.config else 'flat'}"
    )


def random_parameter(path: str, value: mx.array, rng: np.random.Generator) -> mx.array:
    """A random value for one parameter, on a scale that keeps the logits well conditioned."""
    shape = value.shape
    if path.endswith("norm.weight"):
        # MLX-LM stores every RMSNorm's full multiplier (the `+1` folded in).
        drawn = 1 + 0.1 * rng.standard_normal(shape)
    elif path.endswith("A_log"):
        # Decay rates log-uniform over the reference's initial range (up to 16): heads that
        # forget within a token and heads that remember the whole prompt.
        drawn = rng.uniform(np.log(0.01), np.log(16), shape)
    elif path.endswith("dt_bias"):
        drawn = rng.normal(-1.0, 1.0, shape)
    elif path.endswith("conv1d.weight"):
        # [channels, kernel, 1]: each output is about as large as the inputs it mixes.
        drawn = rng.uniform(-1, 1, shape) / np.sqrt(shape[1])
    elif path.endswith("embed_tokens.weight"):
        drawn = rng.standard_normal(shape)
    else:
        # Linear layers keep MLX's uniform(±1/sqrt(fan_in)) initialisation.
        return value
    return mx.array(drawn.astype(np.float32))


def build_model(drawn: SimpleNamespace, seed: int) -> Model:
    """MLX-LM's model for the configuration, with random weights rounded to the storage dtype."""
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(copy.deepcopy(drawn.config)))
    if drawn.text["num_hidden_layers"] < drawn.text["full_attention_interval"]:
        # No full-attention layer: MLX-LM would still build a mask from layer interval - 1's
        # cache, which does not exist; clear the index as its own `pipeline` does in that case.
        model.language_model.model.fa_idx = None
    rng = np.random.default_rng(seed)
    model.update(tree_map_with_path(lambda p, v: random_parameter(p, v, rng), model.parameters()))
    # As MLX-LM's converter casts: everything but A_log.
    model.update(
        tree_map_with_path(
            lambda p, v: v if p.endswith("A_log") else v.astype(drawn.dtype),
            model.parameters(),
        )
    )
    return model


def write_checkpoint(model: Model, drawn: SimpleNamespace, directory: Path, quantized: bool):
    """Saves the model as `mlx_lm.convert` does, quantised (with the model's own predicate, which
    puts the routers at 8 bits) if asked."""
    config = copy.deepcopy(drawn.config)
    if quantized:
        model, config = quantize_model(model, config, drawn.group_size, drawn.bits)
    save_model(directory, model)
    save_config(config, directory / "config.json")


@pytest.fixture(
    scope="module",
    params=[(seed, quantized) for seed in SEEDS for quantized in (False, True)],
    ids=lambda p: f"seed{p[0]}-{'quantized' if p[1] else 'dense'}",
)
def case(request, tmp_path_factory) -> SimpleNamespace:
    """A checkpoint lily reads and MLX-LM's float32 logits for each of its prompts."""
    seed, quantized = request.param
    drawn = draw_config(seed)
    model = build_model(drawn, seed)
    directory = tmp_path_factory.mktemp(f"seed{seed}")
    write_checkpoint(model, drawn, directory, quantized)
    model.set_dtype(mx.float32)
    want = [np.array(model(mx.array([ids]))[0], dtype=np.float32) for ids in drawn.prompts]
    dtype = str(drawn.dtype).removeprefix("mlx.core.")
    setting = f"{drawn.bits}-bit g{drawn.group_size}" if quantized else dtype
    return SimpleNamespace(
        directory=directory,
        prompts=drawn.prompts,
        want=want,
        name=f"seed {seed} ({describe(drawn)}), {setting}",
    )


def lily_logits(model: Path, ids: list[int], path: str) -> np.ndarray:
    out = subprocess.run(
        [LILY, "logits", "--model", model, "--prompt-ids", ",".join(map(str, ids)),
         "--path", path],
        capture_output=True, text=True,
    )
    assert out.returncode == 0, out.stderr
    return np.array(json.loads(out.stdout)["logits"], dtype=np.float32)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_lily_matches_mlx_lm(case, path):
    errors = [
        relative_error(lily_logits(case.directory, ids, path), want)
        for ids, want in zip(case.prompts, case.want)
    ]
    report = ", ".join(f"{len(ids)} tokens {e:.2e}" for ids, e in zip(case.prompts, errors))
    print(f"{case.name}, {path}: lily vs MLX-LM {report}")
    assert max(errors) < TOLERANCE, f"{case.name}, {path}: {report}"

#!/usr/bin/env python3
"""Create the tiny random Qwen3.5-MoE checkpoints under tests/fixtures and their golden outputs.

Run once, by hand, with the pinned reference (the outputs are committed; CI does not run this):

    python3 -m venv /tmp/fx && /tmp/fx/bin/pip install torch==2.11.0 transformers==5.17.0 safetensors
    /tmp/fx/bin/python scripts/make_fixtures.py

Each fixture directory holds config.json, generation_config.json, safetensors weights in one of the
checkpoint layouts lily must read, and `golden.safetensors` + `golden.json` computed by transformers'
`Qwen3_5MoeForCausalLM` in float32 from the stored (rounded) weights:
- `logits.N`: logits of every position of prompt N from one full forward pass (the prefill path);
- `greedy`: 32 greedily generated ids per prompt from `generate` (prefill, then the recurrent
  decode path), with the smallest top-1/top-2 logit gap seen along the way.
"""

import json
import math
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

assert transformers.__version__ == "5.17.0", transformers.__version__
assert torch.__version__.startswith("2.11.0"), torch.__version__

ROOT = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
GEN_TOKENS = 32

FIXTURES = {
    # The official multimodal layout: `text_config` wrapper, `model.language_model.` prefix, packed
    # experts, two shards with an index, bf16 weights (A_log and norms in f32, as real exports do),
    # plus `model.visual.*` and `mtp.*` tensors that must be ignored.
    "tiny-wrapper": dict(
        seed=1,
        wrapper=True,
        packed=True,
        shards=2,
        big_dtype=torch.bfloat16,
        config=dict(
            vocab_size=1024,
            hidden_size=128,
            num_hidden_layers=4,
            full_attention_interval=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000000.0,
                partial_rotary_factor=0.25,
                mrope_section=[1, 1, 2],
                mrope_interleaved=True,
            ),
            eos_token_id=1000,
            tie_word_embeddings=False,
        ),
    ),
    # The text-only export with one tensor per expert, no `language_model.` prefix, one file, f16
    # weights, explicit `layer_types`, a different head layout (one value head per key head, one KV
    # head) and more experts.
    "tiny-text": dict(
        seed=2,
        wrapper=False,
        packed=False,
        shards=1,
        big_dtype=torch.float16,
        config=dict(
            vocab_size=768,
            hidden_size=128,
            num_hidden_layers=5,
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "linear_attention",
                "full_attention",
            ],
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=32,
            linear_value_head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=128,
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
            rope_parameters=dict(
                rope_type="default", rope_theta=1000000.0, partial_rotary_factor=0.25
            ),
            eos_token_id=[700, 701],
            tie_word_embeddings=False,
        ),
    ),
}


def randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Draws weights that keep a deep random model well-conditioned (see ../shared/README.md)."""
    for name, p in model.named_parameters():
        shape = p.shape
        if name.endswith("embed_tokens.weight"):
            v = torch.randn(shape, generator=gen)
        elif name.endswith("lm_head.weight"):
            v = torch.randn(shape, generator=gen) * (4.0 / math.sqrt(shape[-1]))
        elif name.endswith("A_log"):
            v = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith("dt_bias"):
            v = torch.randn(shape, generator=gen) * 0.5
        elif name.endswith("linear_attn.norm.weight"):
            # The gated norm multiplies by w directly.
            v = 1.0 + 0.2 * torch.randn(shape, generator=gen)
        elif "norm" in name:
            # The other norms compute x * (1 + w).
            v = 0.2 * torch.randn(shape, generator=gen)
        elif name.endswith("conv1d.weight"):
            v = torch.randn(shape, generator=gen) * (0.6 / math.sqrt(shape[-1]))
        else:
            v = torch.randn(shape, generator=gen) * (0.6 / math.sqrt(shape[-1]))
        with torch.no_grad():
            p.copy_(v)


def storage_dtype(name: str, big: torch.dtype) -> torch.dtype:
    """Small parameters stay f32, as in the official export; matrices use the fixture's dtype."""
    if name.endswith("A_log") or "norm" in name or name.endswith("dt_bias"):
        return torch.float32
    return big


def checkpoint_tensors(model, spec) -> dict[str, torch.Tensor]:
    """Lays the model's parameters out under the names of the fixture's checkpoint layout."""
    prefix = "model.language_model." if spec["wrapper"] else "model."
    out = {}
    for name, p in model.state_dict().items():
        t = p.detach().to(storage_dtype(name, spec["big_dtype"]))
        if name.startswith("model."):
            base = prefix + name[len("model.") :]
        else:
            base = name
        if not spec["packed"] and ".mlp.experts." in name:
            stem = base[: base.index(".mlp.experts.")] + ".mlp.experts"
            inter = model.config.moe_intermediate_size
            for e in range(t.shape[0]):
                if name.endswith("gate_up_proj"):
                    out[f"{stem}.{e}.gate_proj.weight"] = t[e, :inter].clone()
                    out[f"{stem}.{e}.up_proj.weight"] = t[e, inter:].clone()
                else:
                    out[f"{stem}.{e}.down_proj.weight"] = t[e].clone()
            continue
        out[base] = t.contiguous()
    return out


def extra_tensors(spec, cfg, gen) -> dict[str, torch.Tensor]:
    """Tensors lily must ignore: a vision tower stub and an MTP layer stored per expert."""
    h, dt = cfg.hidden_size, spec["big_dtype"]
    out = {"mtp.fc.weight": torch.randn(h, 2 * h, generator=gen).to(dt)}
    for e in range(2):
        out[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = torch.randn(
            cfg.moe_intermediate_size, h, generator=gen
        ).to(dt)
    if spec["wrapper"]:
        out["model.visual.patch_embed.proj.weight"] = torch.randn(16, 3, 2, 4, 4, generator=gen).to(dt)
        out["model.visual.merger.linear_fc1.weight"] = torch.randn(32, 64, generator=gen).to(dt)
    return out


def write_checkpoint(out_dir: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n] for n in names}, out_dir / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    per = math.ceil(len(names) / shards)
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i * per : (i + 1) * per]}
        save_file(part, out_dir / file, metadata={"format": "pt"})
        for n, t in part.items():
            weight_map[n] = file
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_config(out_dir: Path, spec) -> None:
    text = dict(spec["config"], model_type="qwen3_5_moe_text", hidden_act="silu", dtype="bfloat16")
    if spec["wrapper"]:
        config = {
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "tie_word_embeddings": False,
            "text_config": text,
            "vision_config": {"model_type": "qwen3_5_moe", "depth": 1, "hidden_size": 16},
            "image_token_id": 248056,
        }
    else:
        config = dict(text, architectures=["Qwen3_5MoeForCausalLM"])
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    eos = spec["config"]["eos_token_id"]
    (out_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "do_sample": False}, indent=2) + "\n"
    )


@torch.no_grad()
def golden(model, prompts):
    logits, greedy, margins = {}, [], []
    for i, ids in enumerate(prompts):
        x = torch.tensor([ids])
        logits[f"logits.{i}"] = model(x, use_cache=False).logits[0].float().contiguous()
        out = model.generate(
            x,
            max_new_tokens=GEN_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new = out.sequences[0, len(ids) :].tolist()
        for step in out.logits:
            top = step[0].float().topk(2).values
            margins.append(float(top[0] - top[1]))
        greedy.append(new)
    return logits, greedy, min(margins)


def make(name: str, spec) -> None:
    gen = torch.Generator().manual_seed(spec["seed"])
    cfg = Qwen3_5MoeTextConfig(**spec["config"])
    model = Qwen3_5MoeForCausalLM._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    randomise(model, gen)
    # Round every parameter to its storage dtype so the reference computes with what lily loads.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(p.to(storage_dtype(pname, spec["big_dtype"])).float())
    model.eval()

    out_dir = ROOT / name
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    tensors = checkpoint_tensors(model, spec)
    tensors.update(extra_tensors(spec, cfg, gen))
    write_checkpoint(out_dir, tensors, spec["shards"])
    write_config(out_dir, spec)

    vocab = cfg.vocab_size
    prompts = [
        torch.randint(0, vocab - 100, (9,), generator=gen).tolist(),
        torch.randint(0, vocab - 100, (77,), generator=gen).tolist(),
    ]
    logits, greedy, margin = golden(model, prompts)
    save_file(logits, out_dir / "golden.safetensors")
    meta = {
        "reference": f"transformers {transformers.__version__}, torch {torch.__version__}, float32, eager",
        "prompts": prompts,
        "greedy": greedy,
        "greedy_min_top2_gap": margin,
    }
    (out_dir / "golden.json").write_text(json.dumps(meta, indent=1) + "\n")
    size = sum(f.stat().st_size for f in out_dir.iterdir())
    print(f"{name}: {size / 1e6:.1f} MB, greedy lengths {[len(g) for g in greedy]}, min gap {margin:.4f}")


if __name__ == "__main__":
    for fixture_name, fixture_spec in FIXTURES.items():
        make(fixture_name, fixture_spec)

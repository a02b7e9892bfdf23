#!/usr/bin/env python3
"""Checks lily (CPU and CUDA backends) against transformers on a full-width Qwen3.6-35B-A3B
truncated to 4 layers (3 Gated DeltaNet + 1 attention) with random weights.

Run on the GPU machine (it has torch and transformers), from the repository root, with a lily
built with `--features cuda`:

    python3 scripts/gpu_transformers_check.py --lily target/release/lily --work /tmp/trunc

The reference runs in float32 on the GPU from the same bf16-rounded weights lily loads.
`--shape wide` widens the model past this one (hidden 4096, 32 query heads per 2 KV heads, 64
DeltaNet value heads per 16 key heads, experts of 1024 with top-10 of 32, a smaller vocabulary)
to check the kernels' general shapes. `--quantized` also converts the checkpoint to MLX 4-bit
(g64) and compares lily's CUDA backend with its CPU backend on it.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import randomise, storage_dtype  # noqa: E402

FULL = json.loads((Path(__file__).resolve().parent.parent / "configs/qwen3.6-35b-a3b.json").read_text())

# Text-config fields changed from the full-size model's, per --shape.
SHAPES = {
    "35b": {},
    "wide": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=2, linear_num_value_heads=64,
                 num_experts=32, num_experts_per_tok=10, moe_intermediate_size=1024,
                 shared_expert_intermediate_size=1024, vocab_size=32768, eos_token_id=32767),
}


def lily_logits(lily: str, model_dir: Path, ids, device: str, path: str):
    cmd = [lily, "logits", "--model", str(model_dir), "--prompt-ids", ",".join(map(str, ids)),
           "--path", path, "--device", device, "--context", "256"]
    start = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"lily failed: {out.stderr}")
    return torch.tensor(json.loads(out.stdout)["logits"]), time.time() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lily", default="target/release/lily")
    ap.add_argument("--work", default="/tmp/lily-trunc")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="35b")
    ap.add_argument("--quantized", action="store_true")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    text = dict(FULL["text_config"])
    text.update(SHAPES[args.shape])
    text.update(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
    text.pop("full_attention_interval", None)
    cfg = Qwen3_5MoeTextConfig(**text)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    with torch.device("cpu"):
        model = Qwen3_5MoeForCausalLM._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    randomise(model, gen)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(p.to(storage_dtype(name, torch.bfloat16)).float())
    tensors = {n: t.detach().to(storage_dtype(n, torch.bfloat16)).contiguous()
               for n, t in model.state_dict().items()}
    save_file(tensors, work / "model.safetensors", metadata={"format": "pt"})
    (work / "config.json").write_text(json.dumps(dict(text, architectures=["Qwen3_5MoeForCausalLM"])))
    del tensors

    model = model.cuda().eval()
    ids = torch.randint(0, cfg.vocab_size, (args.tokens,), generator=gen).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids]).cuda(), use_cache=False).logits[0].float().cpu()
    del model
    torch.cuda.empty_cache()

    def rel(x):
        return float((x - ref).abs().max() / ref.abs().max())

    results = {}
    for device, path in [("cuda", "prefill"), ("cuda", "decode"), ("cpu", "prefill")]:
        got, secs = lily_logits(args.lily, work, ids, device, path)
        top1 = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
        results[f"{device}-{path}"] = {"relative_error": rel(got), "top1_agreement": top1, "seconds": secs}
        print(f"lily {device} {path}: relative error {rel(got):.3e}, top-1 agreement {top1:.3f} ({secs:.1f} s)")
    if args.quantized:
        # The 4-bit model has no transformers reference: lily's CPU backend on it is one.
        q4 = work.parent / (work.name + "-q4")
        subprocess.run(["rm", "-rf", str(q4)], check=True)
        subprocess.run([args.lily, "convert", "--model", str(work), "--out", str(q4), "--bits", "4",
                        "--group-size", "64"], check=True, capture_output=True)
        cpu, _ = lily_logits(args.lily, q4, ids, "cpu", "prefill")
        for path in ["prefill", "decode"]:
            got, secs = lily_logits(args.lily, q4, ids, "cuda", path)
            err = float((got - cpu).abs().max() / cpu.abs().max())
            top1 = float((got.argmax(-1) == cpu.argmax(-1)).float().mean())
            results[f"cuda-q4-{path}"] = {"relative_error": err, "top1_agreement": top1, "seconds": secs}
            print(f"lily cuda {path}, 4-bit, against lily cpu: relative error {err:.3e}, "
                  f"top-1 agreement {top1:.3f} ({secs:.1f} s)")
    print(json.dumps(results))
    ok = results["cpu-prefill"]["relative_error"] < 1e-3 and all(
        r["relative_error"] < 3e-2 and r["top1_agreement"] >= 0.9 for k, r in results.items() if k.startswith("cuda")
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

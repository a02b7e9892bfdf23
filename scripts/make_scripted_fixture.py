#!/usr/bin/env python3
"""Makes tests/fixtures/scripted: a tiny qwen3_5_moe checkpoint whose greedy reply is a script.

The server's reasoning and tool-call parsing must be tested end to end, through a real model
run, but a model with random weights never writes `</think>` or a tool call. This model is a
bigram machine built from this architecture: every layer's output projection is zero, so the
residual stream stays the current token's one-hot embedding, and lm_head maps it to the next
token of a script. Its greedy continuation therefore depends only on the last token:

- after "\\n" (the end of Qwen's generation prompt with thinking on, `...<think>\\n`):
  a short thought, `</think>`, "\\n\\n", then a tool call in Qwen's XML form, then `<|im_end|>`;
- after "\\n\\n" (the end of the prompt with thinking off, `...</think>\\n\\n`): the tool call;
- after any other token: "Lily says hello." then `<|im_end|>`.

The tool call's tags are split across tokens, so streaming parsers meet partial tags. The
tokenizer is byte-level BPE (one token per byte, plus a merged "\\n\\n" token, the script's
tokens and the Qwen special tokens); the chat template is the official Qwen3.5/3.6 one.

Run by hand (needs numpy, safetensors, tokenizers; outputs committed):
    .venv/bin/python scripts/make_scripted_fixture.py
"""

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "scripted"

THOUGHT = ["I should check the weather", " in Paris."]
TOOL_CALL = [
    "\n<function=get_weather>\n<param",
    "eter=city>\nPa",
    "ris\n</parameter>\n<parameter=days>\n3\n</para",
    "meter>\n</function>\n",
]
GREETING = ["Lily", " says", " hello."]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
HIDDEN = 32


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def main() -> None:
    alphabet = bytes_to_unicode()
    as_token = lambda text: "".join(alphabet[b] for b in text.encode())  # noqa: E731

    vocab = {alphabet[b]: b for b in range(256)}
    script_texts = ["\n\n"] + THOUGHT + TOOL_CALL + GREETING
    for text in script_texts:
        vocab[as_token(text)] = len(vocab)
    added = SPECIAL + TAGS
    ids = {text: vocab[as_token(text)] for text in script_texts}
    ids["\n"] = ord("\n")
    for i, content in enumerate(added):
        ids[content] = len(vocab) + i
    vocab_size = len(vocab) + len(added)

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[(alphabet[10], alphabet[10])]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in TAGS])
    assert tokenizer.get_vocab_size() == vocab_size

    chain = (
        ["\n"] + THOUGHT + ["</think>", "\n\n", "<tool_call>"] + TOOL_CALL + ["</tool_call>"]
    )
    successor = {a: b for a, b in zip(chain, chain[1:])}
    successor["</tool_call>"] = "<|im_end|>"
    successor.update(zip(GREETING, GREETING[1:]))
    successor[GREETING[-1]] = "<|im_end|>"
    # Dimension 0 stands for every token without a scripted successor; the others, one each.
    dims = {token: i + 1 for i, token in enumerate(successor)}
    assert len(dims) < HIDDEN

    config = {
        "model_type": "qwen3_5_moe_text",
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "tie_word_embeddings": False,
        "dtype": "float32",
    }

    rng = np.random.default_rng(0)
    small = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float32)  # noqa: E731
    zeros = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    h = HIDDEN
    embed = zeros(vocab_size, h)
    embed[:, 0] = 1.0
    lm_head = zeros(vocab_size, h)
    for token, dim in dims.items():
        embed[ids[token]] = 0.0
        embed[ids[token], dim] = 1.0
        lm_head[ids[successor[token]], dim] = 4.0
    lm_head[ids[GREETING[0]], 0] = 4.0
    tensors = {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": lm_head,
        "model.norm.weight": zeros(h),
    }
    for layer, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = zeros(h)
        tensors[p + "post_attention_layernorm.weight"] = zeros(h)
        if kind == "full_attention":
            a = p + "self_attn."
            tensors[a + "q_proj.weight"] = small(2 * 16 * 2, h)
            tensors[a + "k_proj.weight"] = small(16, h)
            tensors[a + "v_proj.weight"] = small(16, h)
            tensors[a + "o_proj.weight"] = zeros(h, 2 * 16)
            tensors[a + "q_norm.weight"] = zeros(16)
            tensors[a + "k_norm.weight"] = zeros(16)
        else:
            a = p + "linear_attn."
            conv_dim = 2 * 16 + 2 * 16
            tensors[a + "in_proj_qkv.weight"] = small(conv_dim, h)
            tensors[a + "in_proj_z.weight"] = small(2 * 16, h)
            tensors[a + "in_proj_b.weight"] = small(2, h)
            tensors[a + "in_proj_a.weight"] = small(2, h)
            tensors[a + "out_proj.weight"] = zeros(h, 2 * 16)
            tensors[a + "conv1d.weight"] = small(conv_dim, 1, 4)
            tensors[a + "A_log"] = np.log(np.full(2, 4.0, np.float32))
            tensors[a + "dt_bias"] = zeros(2)
            tensors[a + "norm.weight"] = np.ones(16, np.float32)
        m = p + "mlp."
        tensors[m + "gate.weight"] = small(4, h)
        tensors[m + "experts.gate_up_proj"] = small(4, 2 * 16, h)
        tensors[m + "experts.down_proj"] = zeros(4, h, 16)
        tensors[m + "shared_expert.gate_proj.weight"] = small(16, h)
        tensors[m + "shared_expert.up_proj.weight"] = small(16, h)
        tensors[m + "shared_expert.down_proj.weight"] = zeros(h, 16)
        tensors[m + "shared_expert_gate.weight"] = small(1, h)

    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    (OUT / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(OUT / "model.safetensors"))
    tokenizer.save(str(OUT / "tokenizer.json"))
    shutil.copy(ROOT / "tests" / "data" / "qwen3.5-chat_template.jinja", OUT / "chat_template.jinja")

    # Check the premise: the generation prompts end with the tokens the script starts from.
    think_on = tokenizer.encode("<|im_start|>assistant\n<think>\n").ids
    think_off = tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n").ids
    assert think_on[-2:] == [ids["<think>"], ids["\n"]], think_on
    assert think_off[-2:] == [ids["</think>"], ids["\n\n"]], think_off
    print(f"wrote {OUT}: vocabulary {vocab_size}, {len(tensors)} tensors")


if __name__ == "__main__":
    main()

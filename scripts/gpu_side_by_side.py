#!/usr/bin/env python3
"""Several lily processes on one GPU at once give what one gives alone.

Runs `lily generate --device cuda` (greedy and sampled, long enough to replay the captured
decode steps many times) once alone, then PEERS copies of the same commands at the same time,
and fails unless every concurrent run returns the solo run's token ids. lily's kernels never wait
on one another's blocks, so a GPU shared with other processes may slow them but must not change
or stall them. Run on the GPU machine from the repository root (gpu_check.sh does):

    python3 scripts/gpu_side_by_side.py --lily target/gpu/lily --model DIR [--peers 3]
"""

import argparse
import json
import subprocess
import sys


def commands(lily, model, tokens):
    prompt = ",".join(str((i * 37) % 200 + 1) for i in range(1, 301))
    base = [lily, "generate", "--model", model, "--prompt-ids", prompt, "--max-tokens", str(tokens),
            "--json", "--device", "cuda", "--context", "1024"]
    return {
        "greedy": base,
        "sampled": base + ["--temperature", "0.8", "--top-p", "0.9", "--seed", "7"],
    }


def ids(output, label):
    try:
        return json.loads(output.strip().splitlines()[-1])["ids"]
    except (IndexError, KeyError, ValueError) as e:
        sys.exit(f"{label}: no ids in the output ({e}): {output[-500:]!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lily", default="target/gpu/lily")
    ap.add_argument("--model", required=True)
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=200)
    args = ap.parse_args()
    failed = False
    for name, cmd in commands(args.lily, args.model, args.tokens).items():
        solo = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if solo.returncode != 0:
            sys.exit(f"{name} alone failed: {solo.stderr[-2000:]}")
        expected = ids(solo.stdout, f"{name} alone")
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(args.peers)]
        for i, p in enumerate(procs):
            out, err = p.communicate(timeout=300)
            label = f"{name}, peer {i + 1} of {args.peers}"
            if p.returncode != 0:
                print(f"FAILED {label}: exit {p.returncode}: {err[-2000:]}")
                failed = True
                continue
            got = ids(out, label)
            if got == expected:
                print(f"ok     {label}: the solo run's {len(got)} tokens")
                continue
            first = next(j for j, (a, b) in enumerate(zip(got + [None], expected + [None])) if a != b)
            print(f"FAILED {label}: {len(got)} tokens, token {first} differs from the solo run's")
            failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Summarises an `ncu --csv --page raw --print-units base` report of N decode steps into a
per-kernel table: launches per step, time per step, share of the step, DRAM traffic and
achieved bandwidth. Prints Markdown (for docs/BENCHMARKS.md).

    python3 scripts/kernel_breakdown.py report.csv --steps 8
"""

import argparse
import csv
import sys
from collections import defaultdict

TIME = "gpu__time_duration.sum"
READ = "dram__bytes_read.sum"
WRITE = "dram__bytes_write.sum"


def number(text):
    return float(text.replace(",", "")) if text else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("report")
    ap.add_argument("--steps", type=int, required=True)
    args = ap.parse_args()

    with open(args.report, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    rows = list(csv.DictReader(lines))
    rows = [r for r in rows if r.get("Kernel Name") and r.get(TIME) and r[TIME] not in ("nsecond", "ns")]
    if not rows:
        sys.exit("no kernel rows in the report")

    total = defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        t = total[r["Kernel Name"]]
        t[0] += 1
        t[1] += number(r[TIME]) * 1e-9
        t[2] += number(r.get(READ, "")) + number(r.get(WRITE, ""))

    step_s = sum(t[1] for t in total.values()) / args.steps
    print(f"Kernel time per decode step: {step_s * 1e6:.1f} us (sum of kernel durations, "
          f"{args.steps} steps, {len(rows)} launches)\n")
    print("| kernel | launches/step | us/step | share of step | DRAM GB/step | GB/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (count, secs, nbytes) in sorted(total.items(), key=lambda kv: -kv[1][1]):
        print(f"| {name} | {count / args.steps:.0f} | {secs / args.steps * 1e6:.1f} | "
              f"{100 * secs / args.steps / step_s:.1f}% | {nbytes / args.steps / 1e9:.4f} | "
              f"{nbytes / secs / 1e9 if secs else 0:.0f} |")


if __name__ == "__main__":
    main()

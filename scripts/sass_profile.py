#!/usr/bin/env python3
"""Where one kernel launch's warps spend their instructions, from Nsight Compute's per-instruction
counts.

The decode kernels are short chains a few warps per scheduler run through; their time is mostly
the instructions each warp executes after its wait, so this is what to read before changing one
(integer divisions, branches around loads and fences showed up here first). On the GPU machine:

    ncu --profile-from-start off --kernel-name matvec_two_rows --launch-skip 1 --launch-count 1 \\
        --section SourceCounters --page source --print-source sass --csv \\
        target/gpu/lily bench --synthetic --quant q4 --prompt 4096 --gen 2 --profile-steps 1 \\
        --no-graphs > matvec_two_rows.csv

then, anywhere: `python3 scripts/sass_profile.py matvec_two_rows.csv [--listing]`. It prints the
SASS size, the warps (executions of the first instruction), the instructions a warp executes on
average, the stall reasons' shares of the samples, and the same counts between consecutive
barriers, fences and exits (the kernel's phases); `--listing` adds every executed instruction with
its executions per warp, samples and main stall reason.
"""

import argparse
import csv
import io
import sys
from dataclasses import dataclass

EXECUTED = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"
# SASS that ends a phase: block and cluster barriers, memory fences, the wait for the previous
# kernel (ACQBULK), exits.
PHASE_ENDS = ("BAR.SYNC", "UCGABAR_WAIT", "MEMBAR", "ACQBULK", "EXIT")


@dataclass
class Instruction:
    source: str
    executed: int
    samples: int
    stalls: dict


def parse(text):
    """The executed SASS of the report's one kernel, in address order."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise ValueError('no "Address" header: not an ncu --page source --csv report')
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header = rows[0]
    for column in ("Source", EXECUTED, SAMPLES):
        if column not in header:
            raise ValueError(f"column {column!r} missing from the report")
    index = {name: i for i, name in enumerate(header)}
    stall_columns = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for row in rows[1:]:
        if len(row) != len(header) or row[0] == "Address":
            continue  # the header repeats once per source view; other lines are ncu's log
        out.append(
            Instruction(
                source=row[index["Source"]].strip(),
                executed=int(row[index[EXECUTED]] or 0),
                samples=int(row[index[SAMPLES]] or 0),
                stalls={h[len("stall_"):]: int(row[index[h]] or 0) for h in stall_columns},
            )
        )
    if not out:
        raise ValueError("the report lists no instructions")
    return out


def warps(instructions):
    """Warps launched: every warp executes the kernel's first instruction once."""
    return max(instructions[0].executed, 1)


def stall_shares(instructions):
    """Each stall reason's share of all samples, largest first."""
    total = sum(i.samples for i in instructions) or 1
    sums = {}
    for ins in instructions:
        for reason, n in ins.stalls.items():
            sums[reason] = sums.get(reason, 0) + n
    return sorted(((r, n / total) for r, n in sums.items() if n), key=lambda t: -t[1])


def phases(instructions):
    """(ending instruction, instructions per warp, samples) between consecutive phase ends."""
    n = warps(instructions)
    out, executed, samples = [], 0, 0
    for ins in instructions:
        executed += ins.executed
        samples += ins.samples
        if ins.executed and any(ins.source.startswith(e) or f" {e}" in ins.source for e in PHASE_ENDS):
            out.append((ins.source, executed / n, samples))
            executed, samples = 0, 0
    if executed or samples:
        out.append(("(end)", executed / n, samples))
    return out


def report(instructions, listing=False):
    n = warps(instructions)
    per_warp = sum(i.executed for i in instructions) / n
    samples = sum(i.samples for i in instructions)
    lines = [
        f"{len(instructions)} SASS instructions, {n} warps, {per_warp:.0f} executed per warp, "
        f"{samples} samples",
        "stalls: " + ", ".join(f"{r} {s:.0%}" for r, s in stall_shares(instructions)[:8]),
        "phases (instructions per warp, samples), each ending at:",
    ]
    for source, count, phase_samples in phases(instructions):
        lines.append(f"  {count:8.1f} {phase_samples:6d}  {source}")
    if listing:
        lines.append("executed instructions (per warp, samples, main stall):")
        for ins in instructions:
            if not ins.executed:
                continue
            main = max(ins.stalls, key=ins.stalls.get) if ins.samples and ins.stalls else ""
            lines.append(f"  {ins.executed / n:7.2f} {ins.samples:5d} {main:16s} {ins.source}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", help="ncu --page source --print-source sass --csv output")
    ap.add_argument("--listing", action="store_true", help="also list every executed instruction")
    args = ap.parse_args(argv)
    try:
        with open(args.report, encoding="utf-8") as f:
            instructions = parse(f.read())
    except (OSError, ValueError) as e:
        print(f"{args.report}: {e}", file=sys.stderr)
        return 1
    print(report(instructions, args.listing))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Summarises a decode-step block timeline written by `lily bench --trace FILE`.

    LILY_TRACE_RECORDS=200000 lily bench --synthetic --quant q4 --prompt 4096 --gen 32 --trace t.csv
    python3 scripts/trace_summary.py t.csv [--launches] [--sms] [--blocks NAME:GROUP ...]

For each launch (in step order) the times are taken against the end of the previous launch's
last block (`prev_end`): `start` when its first/last block started (negative: resident before the
previous launch ended), `wait` when its first block passed its wait for the previous kernel,
`end` when its last block exited (the launch's length on the chain), and the spread of its
blocks' exits. Then the same per launch name, averaged, with the step's total.

`--sms` adds, per launch name, how many SMs worked (held a block that passed its wait; blocks
with nothing to do exit before it) and the median over those SMs of how long each held the
launch's blocks (its first block's start to its last block's exit): a launch's bytes over its
working SMs and that span is what one SM took in while the launch ran.

`--blocks=NAME:GROUP` adds, for the launches named NAME, their blocks in groups of GROUP
consecutive block numbers (in placement order: x, then y, then z), each group's mean start,
wait and exit and its latest exit, over those launches: which blocks of a launch end last (e.g.
`out_proj_route:129` parts its folded-router blocks, placed first, from its projection's).
"""
import argparse
import csv
import statistics
from collections import OrderedDict, defaultdict


def read(lines):
    """The launches of a trace (CSV lines), in step order: name and (start, waited, end, sm, block)
    per block, waited None for a block that exited without waiting."""
    launches = OrderedDict()
    for row in csv.DictReader(lines):
        key = int(row["launch"])
        entry = launches.setdefault(key, {"name": row["name"], "blocks": []})
        waited = int(row["waited_ns"]) if row["waited_ns"] else None
        entry["blocks"].append(
            (int(row["start_ns"]), waited, int(row["end_ns"]), int(row["sm"]), int(row["block"]))
        )
    return OrderedDict(sorted(launches.items()))


def sm_spans(launches):
    """Per launch name: (mean working SMs per launch, mean over its launches of the median
    working SM's span in ns), as `--sms` prints them."""
    per_name = OrderedDict()
    for entry in launches.values():
        spans = {}
        for start, waited, end, sm, _ in entry["blocks"]:
            if waited is None:
                continue
            first, last = spans.get(sm, (start, end))
            spans[sm] = (min(first, start), max(last, end))
        if spans:
            median = statistics.median(last - first for first, last in spans.values())
            per_name.setdefault(entry["name"], []).append((len(spans), median))
    return OrderedDict(
        (name, (statistics.mean(n for n, _ in v), statistics.mean(m for _, m in v)))
        for name, v in per_name.items()
    )


def block_groups(launches, name, group):
    """For the launches named `name`: per group of `group` consecutive block numbers (first block
    number -> (mean start, mean wait, mean exit, latest exit)), ns from the end of the launch
    before each (the previous launch's last exit); the wait's mean over the blocks that waited
    (None where none did)."""
    groups = defaultdict(lambda: ([], [], []))
    prev_end = None
    for entry in launches.values():
        if entry["name"] == name and prev_end is not None:
            for start, waited, end, _, block in entry["blocks"]:
                starts, waits, ends = groups[block // group * group]
                starts.append(start - prev_end)
                ends.append(end - prev_end)
                if waited is not None:
                    waits.append(waited - prev_end)
        prev_end = max(b[2] for b in entry["blocks"])
    return OrderedDict(
        (first, (statistics.mean(s), statistics.mean(w) if w else None, statistics.mean(e), max(e)))
        for first, (s, w, e) in sorted(groups.items())
    )


def block_spec(value):
    """`--blocks`'s NAME:GROUP, as (name, group)."""
    name, _, group = value.partition(":")
    if not name or not group.isdigit() or int(group) == 0:
        raise argparse.ArgumentTypeError(f"takes NAME:GROUP (GROUP blocks, at least 1), got '{value}'")
    return name, int(group)


def arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="the CSV that `lily bench --trace` wrote")
    parser.add_argument("--launches", action="store_true", help="a row for every launch as well")
    parser.add_argument("--sms", action="store_true", help="working SMs and their spans per launch name")
    parser.add_argument(
        "--blocks",
        type=block_spec,
        action="append",
        default=[],
        metavar="NAME:GROUP",
        help="the blocks of the launches named NAME, in groups of GROUP block numbers (repeatable)",
    )
    return parser, parser.parse_args(argv)


def main():
    parser, args = arguments()
    try:
        with open(args.trace) as f:
            launches = read(f)
    except OSError as e:
        parser.error(f"cannot read the trace {args.trace}: {e.strerror}")
    rows = []
    prev_end = None
    for key, e in launches.items():
        starts = sorted(b[0] for b in e["blocks"])
        waits = sorted(b[1] for b in e["blocks"] if b[1] is not None)
        ends = sorted(b[2] for b in e["blocks"])
        base = prev_end if prev_end is not None else starts[0]
        r = {
            "launch": key,
            "name": e["name"],
            "blocks": len(starts),
            "sms": len({b[3] for b in e["blocks"]}),
            "first_start": starts[0] - base,
            "last_start": starts[-1] - base,
            "first_wait": (waits[0] - base) if waits else float("nan"),
            "median_end": statistics.median(ends) - base,
            "end": ends[-1] - base,
            "post_wait_median": statistics.median(
                b[2] - b[1] for b in e["blocks"] if b[1] is not None
            )
            if waits
            else float("nan"),
        }
        rows.append(r)
        prev_end = ends[-1]
    fmt = "{:>5} {:<20} {:>6} {:>4} {:>9.2f} {:>9.2f} {:>9.2f} {:>9.2f} {:>9.2f} {:>9.2f}"
    head = "{:>5} {:<20} {:>6} {:>4} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}".format(
        "#", "name", "blocks", "SMs", "1st start", "lst start", "1st wait", "med end", "end", "post-wait"
    )
    if args.launches:
        print("per launch, us from the previous launch's last exit")
        print(head)
        for r in rows:
            print(
                fmt.format(
                    r["launch"], r["name"], r["blocks"], r["sms"],
                    r["first_start"] / 1e3, r["last_start"] / 1e3, r["first_wait"] / 1e3,
                    r["median_end"] / 1e3, r["end"] / 1e3, r["post_wait_median"] / 1e3,
                )
            )
    by_name = OrderedDict()
    for r in rows:
        by_name.setdefault(r["name"], []).append(r)
    print("\nper launch name, mean us from the previous launch's last exit")
    print(head + " {:>9}".format("us/step"))
    total = 0.0
    for name, rs in by_name.items():
        def mean(k):
            return statistics.mean(r[k] for r in rs) / 1e3
        step = sum(r["end"] for r in rs) / 1e3
        total += step
        print(
            fmt.format(
                len(rs), name, rs[0]["blocks"], rs[0]["sms"], mean("first_start"),
                mean("last_start"), mean("first_wait"), mean("median_end"), mean("end"),
                mean("post_wait_median"),
            )
            + " {:>9.1f}".format(step)
        )
    first = min(b[0] for e in launches.values() for b in e["blocks"])
    last = max(b[2] for e in launches.values() for b in e["blocks"])
    print(f"\n{len(rows)} launches; step {(last - first) / 1e3:.1f} us from first start to last exit")
    gaps = defaultdict(list)
    for r in rows:
        if r["first_wait"] == r["first_wait"]:
            gaps[r["name"]].append(r["first_wait"])
    print("release after the previous launch's last exit (first wait, us): "
          + ", ".join(f"{n} {statistics.mean(v) / 1e3:.2f}" for n, v in gaps.items()))
    if args.sms:
        print("\nper launch name: SMs that worked (a block past its wait), median us one held the launch")
        for name, (sms, span) in sm_spans(launches).items():
            print(f"{name:<20} {sms:>6.1f} {span / 1e3:>9.2f}")
    for name, group in args.blocks:
        print(f"\n{name}: blocks in groups of {group}, mean us from the previous launch's last exit")
        print("{:>7} {:>9} {:>9} {:>9} {:>9}".format("blocks", "start", "wait", "exit", "last exit"))
        for first, (start, wait, end, last) in block_groups(launches, name, group).items():
            shown = "-" if wait is None else f"{wait / 1e3:.2f}"
            print(f"{first:>7} {start / 1e3:>9.2f} {shown:>9} {end / 1e3:>9.2f} {last / 1e3:>9.2f}")


if __name__ == "__main__":
    main()

"""scripts/ab_decode.sh against a stand-in for `lily bench` that prints decode lines as lily does
(its rate chosen by the environment the variant's command sets) and records the order it ran in."""

import os
import signal
import stat
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "ab_decode.sh"

FAKE = """#!/usr/bin/env bash
echo "$LABEL $*" >> "$ORDER"
# With HANG_FROM=N, the Nth run and later hang (until a signal ends them).
if [ -n "${HANG_FROM:-}" ] && [ "$(wc -l < "$ORDER")" -ge "$HANG_FROM" ]; then sleep 60; fi
echo "model              synthetic"
echo "decode             ${RATE}.0 tok/s at ~4160 context (1.300 ms/token)"
echo "decode traffic     1.877 GB/token, 1450 GB/s achieved = 34.1% of copy bandwidth (limit 2261 tok/s)"
case " $* " in *" --batch 8 "*) echo "decode batch 8     $((RATE * 2)).5 tok/s in all, 246.5 per sequence";; esac
case " $* " in *" --critical-path "*)
    echo "decode critical path, per kernel (step $((RATE + 600)).5 us replayed):"
    echo "  moe_gate_up              40 launches    238.0 us   5.95 us each  18.5%"
    echo "  lm_head                   1 launches     79.4 us  $((RATE / 10)).40 us each   6.2%"
    echo "decode batch 8 critical path, per kernel (step 4000.0 us replayed):"
    echo "  moe_gate_up              40 launches    480.0 us  12.00 us each  12.0%";;
esac
exit "${FAIL:-0}"
"""


def fake_lily(tmp_path):
    """FAKE as an executable `lily` in tmp_path."""
    fake = tmp_path / "lily"
    fake.write_text(FAKE)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return fake


def run(tmp_path, *args):
    fake = fake_lily(tmp_path)
    order = tmp_path / "order.txt"
    env = dict(os.environ, ORDER=str(order))
    out = subprocess.run(
        ["bash", str(SCRIPT), "-l", str(tmp_path / "logs"), *[a.replace("LILY", str(fake)) for a in args]],
        capture_output=True,
        text=True,
        env=env,
    )
    runs = order.read_text().splitlines() if order.exists() else []
    return out, runs


def summary(stdout):
    """{(variant, decode kind): (runs, mean, lowest, highest)} from the closing table."""
    rows = {}
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("variant"))
    for line in lines[start + 1 :]:
        parts = line.split()
        kind = " ".join(parts[1:-4])
        rows[(parts[0], kind)] = (int(parts[-4]), *map(float, parts[-3:]))
    return rows


def test_variants_alternate_and_are_summarised(tmp_path):
    out, runs = run(
        tmp_path,
        "-r",
        "3",
        "old=env LABEL=old RATE=700 LILY",
        "new=env LABEL=new RATE=770 LILY",
        "--",
        "--synthetic",
        "--batch",
        "8",
        "--critical-path",
        "5",
    )
    assert out.returncode == 0, out.stderr
    # A warm-up each, then rounds in alternating order, every run with `bench` and the arguments.
    assert [r.split()[0] for r in runs] == ["old", "new", "old", "new", "new", "old", "old", "new"]
    args = ["bench", "--synthetic", "--batch", "8", "--critical-path", "5"]
    assert all(r.split()[1:] == args for r in runs)
    rows = summary(out.stdout)
    # The traffic line's "limit ... tok/s" is not a decode rate, and the batch's critical path
    # is not the one sequence's.
    assert rows == {
        ("old", "one sequence"): (3, 700.0, 700.0, 700.0),
        ("old", "batch 8"): (3, 1400.5, 1400.5, 1400.5),
        ("old", "step us"): (3, 1300.5, 1300.5, 1300.5),
        ("old", "us moe_gate_up"): (3, 5.95, 5.95, 5.95),
        ("old", "us lm_head"): (3, 70.4, 70.4, 70.4),
        ("new", "one sequence"): (3, 770.0, 770.0, 770.0),
        ("new", "batch 8"): (3, 1540.5, 1540.5, 1540.5),
        ("new", "step us"): (3, 1370.5, 1370.5, 1370.5),
        ("new", "us moe_gate_up"): (3, 5.95, 5.95, 5.95),
        ("new", "us lm_head"): (3, 77.4, 77.4, 77.4),
    }


def test_default_bench_arguments_and_a_failing_variant(tmp_path):
    out, runs = run(tmp_path, "-r", "1", "ok=env LABEL=ok RATE=700 LILY", "bad=env LABEL=bad RATE=1 FAIL=3 LILY")
    assert out.returncode == 1
    assert "FAILED bad-1" in out.stdout and "FAILED warm-up of bad" in out.stdout
    assert runs[0].split()[1:] == ["bench", "--synthetic", "--quant", "q4", "--prompt", "4096", "--gen", "64"]
    # The failed runs count for nothing.
    assert summary(out.stdout) == {("ok", "one sequence"): (1, 700.0, 700.0, 700.0)}


def test_bad_usage_is_refused(tmp_path):
    for args in (["-r", "0", "a=LILY"], ["no-label"], []):
        out, runs = run(tmp_path, *args)
        assert out.returncode == 2, args
        assert out.stderr.startswith("ab_decode.sh:"), args
        assert runs == []


def test_a_signal_prints_the_runs_that_finished(tmp_path):
    fake = fake_lily(tmp_path)
    order = tmp_path / "order.txt"
    # Two warm-ups and round 1 finish; round 2's first run hangs, as a run cut by `timeout`.
    env = dict(os.environ, ORDER=str(order), HANG_FROM="5")
    args = ["-r", "3", f"a=env LABEL=a RATE=700 {fake}", f"b=env LABEL=b RATE=750 {fake}"]
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "-l", str(tmp_path / "logs"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while not (order.exists() and len(order.read_text().splitlines()) >= 5):
        assert time.monotonic() < deadline, "the fifth run never started"
        time.sleep(0.05)
    # As `timeout` does: the whole process group, the hanging run included.
    os.killpg(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 124, stderr
    assert "stopped by a signal" in stdout
    assert summary(stdout) == {
        ("a", "one sequence"): (1, 700.0, 700.0, 700.0),
        ("b", "one sequence"): (1, 750.0, 750.0, 750.0),
    }

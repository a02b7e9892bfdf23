"""scripts/trace_summary.py on a small block timeline in `lily bench --trace`'s CSV layout: two
launches of one kernel and one of another, with blocks sharing an SM and a block that exits
without waiting (a split with no positions)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "trace_summary.py"
spec = importlib.util.spec_from_file_location("trace_summary", SCRIPT)
trace_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trace_summary)

# launch, name, block, sm, start_ns, waited_ns, end_ns
BLOCKS = [
    # Launch 0: SM 3 holds two blocks (its span runs from the first's start to the second's exit),
    # SM 5 one; the block on SM 7 has nothing to do and leaves before the wait.
    (0, "matvec", 0, 3, 0, 500, 4_000),
    (0, "matvec", 1, 3, 1_000, 1_500, 6_000),
    (0, "matvec", 2, 5, 200, 600, 2_200),
    (0, "matvec", 3, 7, 100, None, 300),
    # Launch 1, of another kernel, after launch 0's last exit (6,000).
    (1, "split", 0, 3, 5_000, 6_500, 9_000),
    (1, "split", 1, 5, 5_500, 6_600, 10_000),
    # Launch 2: matvec again, on one SM.
    (2, "matvec", 0, 5, 9_000, 10_500, 13_000),
]


def csv_lines():
    lines = ["launch,name,block,sm,start_ns,waited_ns,end_ns"]
    for launch, name, block, sm, start, waited, end in BLOCKS:
        lines.append(f"{launch},{name},{block},{sm},{start},{'' if waited is None else waited},{end}")
    return lines


def test_read_keeps_launch_order_and_blocks_without_a_wait():
    launches = trace_summary.read(csv_lines())
    assert list(launches) == [0, 1, 2]
    assert [e["name"] for e in launches.values()] == ["matvec", "split", "matvec"]
    assert launches[0]["blocks"][3] == (100, None, 300, 7, 3)


def test_sm_spans_count_only_working_sms_and_span_their_blocks():
    spans = trace_summary.sm_spans(trace_summary.read(csv_lines()))
    # matvec: launch 0 works on SMs 3 (0 -> 6,000) and 5 (200 -> 2,200), median 4,000; SM 7 idles.
    # Launch 2: one SM, 4,000. Means over the two launches: 1.5 SMs, 4,000 ns.
    assert spans["matvec"] == (pytest.approx(1.5), pytest.approx(4_000))
    # split: spans 4,000 and 4,500.
    assert spans["split"] == (pytest.approx(2), pytest.approx(4_250))


def test_block_groups_time_blocks_from_the_previous_launch_end():
    launches = trace_summary.read(csv_lines())
    # matvec launch 0 has no launch before it and is left out; launch 2 follows split's last exit
    # (10,000): its one block starts at -1,000, waits at 500 and exits at 3,000.
    assert trace_summary.block_groups(launches, "matvec", 2) == {0: (-1_000, 500, 3_000, 3_000)}
    # split follows matvec's last exit (6,000); in groups of one block, then of two.
    assert trace_summary.block_groups(launches, "split", 1) == {
        0: (-1_000, 500, 3_000, 3_000),
        1: (-500, 600, 4_000, 4_000),
    }
    assert trace_summary.block_groups(launches, "split", 2) == {0: (-750, 550, 3_500, 4_000)}


def test_block_groups_leave_the_wait_out_where_no_block_waited():
    lines = csv_lines() + ["3,tail,0,3,13000,,13100", "3,tail,1,5,13050,,13200"]
    groups = trace_summary.block_groups(trace_summary.read(lines), "tail", 2)
    assert groups == {0: (25, None, 150, 200)}


def test_script_prints_the_sm_table(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("\n".join(csv_lines()) + "\n")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(trace), "--launches", "--sms"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "3 launches; step 13.0 us from first start to last exit" in out
    table = out.split("median us one held the launch\n", 1)[1].splitlines()
    assert table[0].split() == ["matvec", "1.5", "4.00"]
    assert table[1].split() == ["split", "2.0", "4.25"]


def test_script_prints_block_groups(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("\n".join(csv_lines()) + "\n")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(trace), "--blocks=split:1"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    table = out.split("split: blocks in groups of 1", 1)[1].splitlines()
    assert table[2].split() == ["0", "-1.00", "0.50", "3.00", "3.00"]
    assert table[3].split() == ["1", "-0.50", "0.60", "4.00", "4.00"]


@pytest.mark.parametrize("value", ["split", "split:0", "split:x", ":4"])
def test_script_names_a_malformed_blocks_argument(tmp_path, value):
    trace = tmp_path / "t.csv"
    trace.write_text("\n".join(csv_lines()) + "\n")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(trace), f"--blocks={value}"], capture_output=True, text=True
    )
    assert done.returncode != 0
    assert f"argument --blocks: takes NAME:GROUP (GROUP blocks, at least 1), got '{value}'" in done.stderr
    assert "Traceback" not in done.stderr


def test_script_names_a_missing_trace_and_an_unknown_option(tmp_path):
    missing = tmp_path / "none.csv"
    done = subprocess.run([sys.executable, str(SCRIPT), str(missing)], capture_output=True, text=True)
    assert done.returncode != 0
    assert f"cannot read the trace {missing}" in done.stderr
    assert "Traceback" not in done.stderr
    trace = tmp_path / "t.csv"
    trace.write_text("\n".join(csv_lines()) + "\n")
    done = subprocess.run([sys.executable, str(SCRIPT), str(trace), "--threads=4"], capture_output=True, text=True)
    assert done.returncode != 0
    assert "unrecognized arguments: --threads=4" in done.stderr

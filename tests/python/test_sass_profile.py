"""scripts/sass_profile.py on a small report in Nsight Compute's per-instruction CSV layout: ncu's
log lines before the table, a repeated header, two stall columns and their not-issued twins."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "sass_profile.py"
spec = importlib.util.spec_from_file_location("sass_profile", SCRIPT)
sass_profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_profile)

HEADER = (
    '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
    '"stall_wait","stall_long_sb","stall_wait (Not Issued)","stall_long_sb (Not Issued)"'
)

# 4 warps: 3 instructions before the wait (once each), a loop body run twice per warp, a barrier,
# an instruction only half of the warps reach, the exit.
ROWS = [
    ("0x00", "LDC R1, c[0x0][0x28]", 2, 4, 2, 0),
    ("0x10", "LDG.E.128 R4, desc[UR4][R2.64]", 0, 4, 0, 0),
    ("0x20", "ACQBULK", 6, 4, 6, 0),
    ("0x30", "IDP.2A.LO.S16.S8 R9, R4, R5, R9", 10, 8, 2, 8),
    ("0x40", "@P0 BRA 0x30", 0, 8, 0, 0),
    ("0x50", "BAR.SYNC.DEFER_BLOCKING 0x0", 4, 4, 4, 0),
    ("0x60", "STG.E [R2.64], R9", 2, 2, 0, 2),
    ("0x70", "EXIT", 0, 4, 0, 0),
    ("0x80", "BRA 0x80", 0, 0, 0, 0),
]


def report_text():
    lines = ["==PROF== Connected to process 1", "model  synthetic", HEADER]
    for address, source, samples, executed, wait, long_sb in ROWS:
        lines.append(f'"{address}","      {source}","{samples}","{executed}","{wait}","{long_sb}","0","0"')
    lines.append(HEADER)  # ncu repeats the header per source view
    return "\n".join(lines) + "\n"


def test_counts_per_warp_and_stall_shares():
    instructions = sass_profile.parse(report_text())
    assert len(instructions) == len(ROWS)
    assert sass_profile.warps(instructions) == 4
    assert sum(i.executed for i in instructions) / 4 == pytest.approx(38 / 4)
    shares = dict(sass_profile.stall_shares(instructions))
    assert shares["wait"] == pytest.approx(14 / 24)
    assert shares["long_sb"] == pytest.approx(10 / 24)


def test_phases_end_at_the_wait_barriers_and_exits():
    phases = sass_profile.phases(sass_profile.parse(report_text()))
    assert [(source, count, samples) for source, count, samples in phases] == [
        ("ACQBULK", 3.0, 8),
        ("BAR.SYNC.DEFER_BLOCKING 0x0", 5.0, 14),
        ("EXIT", 1.5, 2),
    ]


def test_listing_shows_only_executed_instructions(tmp_path):
    path = tmp_path / "k.csv"
    path.write_text(report_text())
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(path), "--listing"], check=True, capture_output=True, text=True
    ).stdout
    assert "9 SASS instructions, 4 warps, 10 executed per warp, 24 samples" in out
    assert "IDP.2A.LO.S16.S8" in out and "long_sb" in out
    assert "BRA 0x80" not in out


def test_a_file_that_is_not_a_source_report_is_an_error(tmp_path):
    path = tmp_path / "raw.csv"
    path.write_text('"ID","Kernel Name","gpu__time_duration.sum"\n"0","matvec","3.2"\n')
    done = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True)
    assert done.returncode == 1
    assert "not an ncu --page source --csv report" in done.stderr

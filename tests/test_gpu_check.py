"""bench/gpu_check.sh --cpu-smoke: every row of the GPU check but 7a (7b's code) at toy size on the CPU, in an
environment like the GPU image's: only `python3` on PATH (no `python`) and no package index for pip."""
import os
import signal
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.slow
def test_gpu_check_cpu_smoke_every_row_but_7a_ok(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if sys.prefix == sys.base_prefix:
        (bin_dir / "python3").symlink_to(sys.executable)
    else:  # a venv is found next to the path it is started by: a symlink elsewhere would lose it
        (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (bin_dir / "python3").chmod(0o755)
    keep = ("HOME", "LANG", "LC_ALL", "TMPDIR", "BERT_DDP_CACHE")  # BERT_DDP_CACHE: conftest's temporary one
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(PATH=f"{bin_dir}:/usr/bin:/bin", PIP_NO_INDEX="1", OUT=str(tmp_path / "out"),
               RUNS=str(tmp_path / "runs"))
    assert subprocess.run(["bash", "-c", "command -v python"], env=env, capture_output=True).returncode != 0
    assert subprocess.run(["bash", "-n", "bench/gpu_check.sh"], cwd=ROOT).returncode == 0

    proc = subprocess.Popen(["bash", "bench/gpu_check.sh", "--cpu-smoke"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=360)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # each of its commands has its own timeout inside the budget
        output, _ = proc.communicate()
        raise AssertionError(f"over 360 s:\n{output[-4000:]}") from None
    assert proc.returncode == 0, output[-4000:]
    with open(tmp_path / "out" / "table.txt") as f:
        rows = [line.split(" | ", 1) for line in f.read().splitlines() if line.strip()]
    labels = [label.split()[0] for label, _ in rows]
    assert labels == ["data:", "1", "2", "3", "4", "5", "7a", "7b", "8", "6"], output[-4000:]
    # 7a runs 7b's code at sizes rows 2, 5 and 6 run: the smoke leaves it out, and says so
    assert rows[6][1] == "not run in the smoke: 7b's code", rows
    bad = [f"{label.strip()}: {result}" for label, result in rows if not result.startswith("ok") and label[:2] != "7a"]
    assert not bad, "\n".join(bad) + "\n" + output[-4000:]

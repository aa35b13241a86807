"""The command line's users: a user mistake is one line with status 2 (never a traceback), the torchrun
launcher passes the command's arguments through as given, and `serve` under torchrun drains on SIGTERM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tp_runtime.cli", *args],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _one_error_line(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2, f"status {proc.returncode}:\n{output[-3000:]}"
    assert output.startswith("tp-runtime: error: "), output[-3000:]
    assert len(output.splitlines()) == 1, output[-3000:]
    for fragment in fragments:
        assert fragment in output, f"{fragment!r} not in {output!r}"


def test_bench_throughput_negative_workload_seed_is_one_line() -> None:
    proc = _cli("bench", "throughput", "--model", "tiny-llama", "--num-prompts", "2", "--input-len", "4",
                "--output-len", "2", "--workload-seed", "-1")  # fmt: skip
    _one_error_line(proc, "--workload-seed", "at least 0", "got -1")

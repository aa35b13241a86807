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


def _launch_script(
    tmp_path: Path, *args: str, torchrun_args: str | None = None
) -> subprocess.CompletedProcess[str]:
    """scripts/launch_tp.sh with a stand-in for the venv's Python that prints the arguments it gets, one a
    line: what the script would hand tp_runtime.launch."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    python.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    python.chmod(0o755)
    env = {**ENV, "VIRTUAL_ENV": str(venv)}
    env.pop("TORCHRUN_ARGS", None)
    if torchrun_args is not None:
        env["TORCHRUN_ARGS"] = torchrun_args
    return subprocess.run(
        ["bash", "scripts/launch_tp.sh", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=30
    )


def test_launch_script_puts_the_tp_size_before_a_double_dash(tmp_path: Path) -> None:
    """After `--` every word is a prompt: the TP size the script adds must come before it."""
    proc = _launch_script(tmp_path, "2", "generate", "--max-tokens", "4", "--", "-a prompt", "--")
    assert proc.returncode == 0, proc.stderr
    command = proc.stdout.splitlines()
    command = command[command.index("--") + 1 :]  # what follows tp_runtime.launch's own `--`
    assert command == [
        "generate",
        "--max-tokens",
        "4",
        "--tensor-parallel-size",
        "2",
        "--",
        "-a prompt",
        "--",
    ]
    proc = _launch_script(tmp_path, "2", "generate", "a prompt", torchrun_args="--nnodes 2 --node-rank 0")
    command = proc.stdout.splitlines()
    assert command[command.index("--") + 1 :] == ["generate", "a prompt", "--tensor-parallel-size", "4"]


def test_launch_script_bad_nproc_is_one_line(tmp_path: Path) -> None:
    for nproc, torchrun_args in (
        ("abc", None),
        ("2x", None),
        ("0", None),
        ("2", "--nnodes 1:2"),
        ("2", "--nnodes"),
    ):
        proc = _launch_script(tmp_path, nproc, "generate", "a prompt", torchrun_args=torchrun_args)
        assert proc.returncode == 2, (nproc, torchrun_args, proc.stdout, proc.stderr)
        assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith("tp-runtime: error: "), proc.stderr

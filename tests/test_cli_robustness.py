"""The command line's users: a user mistake is one line with status 2 (never a traceback), the torchrun
launcher passes the command's arguments through as given, `serve` under torchrun drains on SIGTERM, and
the benchmarks write strict JSON."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_cli_args import ENV, REPO, _cli, _one_error_line


def test_bench_throughput_negative_workload_seed_is_one_line() -> None:
    proc = _cli("bench", "throughput", "--model", "tiny-llama", "--num-prompts", "2", "--input-len", "4",
                "--output-len", "2", "--workload-seed", "-1")  # fmt: skip
    _one_error_line(proc, "--workload-seed", "at least 0", "got -1")


def test_bench_serve_unparsable_base_url_is_one_line() -> None:
    _one_error_line(
        _cli("bench", "serve", "--base-url", "http://[::1:8000"), "--base-url", "http://[::1:8000"
    )


def test_output_json_naming_a_folder_is_refused_before_the_run(tmp_path: Path) -> None:
    for command in (["generate", "--model", "tiny-llama", "--max-tokens", "2"], ["bench", "serve"]):
        _one_error_line(_cli(*command, "--output-json", str(tmp_path)), "--output-json", "is a folder")


def test_output_json_with_a_tilde_the_shell_left_is_written_in_home(tmp_path: Path) -> None:
    """`--output-json=~/x.json` (no shell expansion after `=`): checked, and written, in the home folder."""
    home = tmp_path / "home"

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tp_runtime.cli", "bench", "messaging", "-tp", "1", "--steps", "1",
             "--num-requests", "1", "--output-json=~/out.json"],
            cwd=tmp_path, env={**ENV, "HOME": str(home)}, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    proc = run()
    assert proc.returncode == 2 and str(home) in proc.stderr, proc.stderr  # no home folder yet
    home.mkdir()
    proc = run()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (home / "out.json").is_file()


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


def test_serve_under_torchrun_drains_on_sigterm() -> None:
    """`kill -TERM` on a torchrun-launched server drains, as a plain `serve` does: torchrun passes the signal
    to every rank, and rank 1 must stay for rank 0's requests in flight (it used to die at once, and the
    stream got a 500 naming the dead rank)."""
    import http.client
    import json
    import re
    import signal

    env = {**ENV, "VIRTUAL_ENV": sys.prefix}
    env.pop("TORCHRUN_ARGS", None)
    launcher = subprocess.Popen(
        ["bash", "scripts/launch_tp.sh", "2", "serve", "tiny-llama", "--port", "0", "--shutdown-grace", "1"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert launcher.stdout is not None
    log: list[str] = []
    try:
        for line in launcher.stdout:
            log.append(line)
            ready = re.search(r"ready on http://127\.0\.0\.1:(\d+)", line)
            if ready:
                break
        else:
            raise AssertionError("the server never became ready:\n" + "".join(log)[-3000:])
        ranks = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
        conn = http.client.HTTPConnection("127.0.0.1", int(ready.group(1)), timeout=60)
        body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        events = []
        for raw in response:
            event = raw.decode().strip()
            if not event.startswith("data:"):
                continue
            events.append(event)
            if len(events) == 1:  # the request runs on both ranks now
                launcher.send_signal(signal.SIGTERM)
        output, _ = launcher.communicate(timeout=60)
        log.append(output)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert events[-1] == "data: [DONE]", events[-3:]
    last = json.loads(events[-2].removeprefix("data:"))
    assert "error" not in last, "".join(log)[-3000:]
    assert last["choices"][0]["finish_reason"] == "abort", last
    assert "tp-runtime serve: shut down" in "".join(log)
    for pid in ranks:  # both ranks are gone
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_benchmark_json_is_strict_json(tmp_path: Path) -> None:
    """A figure that does not exist (bench latency --output-len 1 has no decode step to time: a NaN
    roofline fraction) is written as null: `NaN` is not JSON, and strict parsers refuse the file."""
    from tp_runtime.bench import write_json
    from tp_runtime.bench.latency import decode_roofline

    traffic = {"weight_bytes": 1e9, "kv_bytes_per_token": 1e3, "copy_bandwidth": 1e12}
    roofline = decode_roofline(traffic, 1, 32, 1, None, float("nan"))
    out = tmp_path / "latency.json"
    write_json(
        str(out), {"decode_roofline": roofline, "latencies": [0.5, float("inf")], "pair": (1, float("-inf"))}
    )

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in the JSON")

    data = json.loads(out.read_text(), parse_constant=refuse)
    assert data["decode_roofline"]["fraction"] is None and data["decode_roofline"]["step"] is None
    assert data["latencies"] == [0.5, None] and data["pair"] == [1, None]


def test_torchrun_gives_serve_its_drain_before_its_sigkill(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun SIGKILLs the ranks 30 s (its default) after passing a SIGTERM on, which cut a `serve`
    drain of the default 30 s grace short: the launcher gives serve's ranks the drain and some slack, and
    leaves a timeout the user set (a flag or TORCH_ELASTIC_SHUTDOWN_TIMEOUT) as it is."""
    import torch.distributed.run

    from tp_runtime import launch
    from tp_runtime.server.runner import DRAIN_MARGIN_S

    seen: list[Any] = []
    monkeypatch.setattr(torch.distributed.run, "run", lambda args: seen.append(args.shutdown_timeout))
    monkeypatch.setattr(launch, "_stop_ranks_with_sigterm_on_ctrl_c", lambda interrupts: None)
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    for name in ("OMP_NUM_THREADS", launch.cli.LAUNCHED_ENV):
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    serve = argparse.Namespace(command="serve", shutdown_grace=50.0)
    drain = launch._drain_s(serve)
    assert drain == 50.0 + DRAIN_MARGIN_S and launch._drain_s(argparse.Namespace(command="generate")) is None
    torchrun = ["--standalone", "--nproc-per-node", "2"]
    for extra, env, want in (
        ([], None, math.ceil(drain) + launch._SHUTDOWN_SLACK_S),
        (["--shutdown-timeout", "7"], None, 7),
        ([], "9", None),
    ):
        if env is not None:
            monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", env)
        assert launch._run_torchrun([*torchrun, *extra], ["serve"], launch._Interrupts(), drain) == 0
        assert seen.pop() == want

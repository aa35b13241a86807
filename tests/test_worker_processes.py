"""Spawned workers are fresh interpreters (`python -m tp_runtime.worker.process`), not multiprocessing
children: a flat user script with no `if __name__ == "__main__":` guard runs at TP=2, the HMAC key never
shows on a worker's command line, and killing the driver leaves no worker behind."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import hf_greedy
from test_faults import alive, wait_gone

from tp_runtime import LLM
from tp_runtime.config import CacheConfig, EngineConfig, ParallelConfig, build_model_config
from tp_runtime.errors import WorkerDiedError
from tp_runtime.messages import PROTOCOL
from tp_runtime.worker.process import SpawnArgs, encode_spawn_args, read_spawn_args

pytestmark = pytest.mark.slow

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10]]
MAX_TOKENS = 6

# A user's script exactly as one writes it without knowing about spawn: no __main__ guard. It prints the
# tokens, its worker pids and their command lines, then waits for stdin to close (or to be killed).
_FLAT_SCRIPT = """
import json, os, sys
from tp_runtime import LLM, SamplingParams

llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", dtype="float32")
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                    SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]), ignore_eos=True),
                    use_tqdm=False)
pids = llm.engine.executor.worker_pids()
cmdlines = [open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace") for pid in pids]
key = llm.engine.executor.channel.key
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "pids": pids, "cmdlines": cmdlines,
                  "key_hex": key.hex(), "ipc_dir": llm.engine.executor.ipc_dir}), flush=True)
sys.stdin.read()
print("done", flush=True)
"""


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint()


class _Driver:
    def __init__(self, proc: subprocess.Popen[str], lines: queue.Queue[str], log: Path) -> None:
        self.proc, self.lines, self.log = proc, lines, log
        self.worker_pids: list[int] = []

    def first_report(self, timeout_s: float = 120.0) -> dict[str, object]:
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            pytest.fail(f"the script printed nothing in {timeout_s} s; stderr:\n{self.log.read_text()}")
        try:
            report: dict[str, object] = json.loads(line)
        except ValueError:
            pytest.fail(f"unexpected output {line!r}; stderr:\n{self.log.read_text()}")
        self.worker_pids = [int(p) for p in report["pids"]]  # type: ignore[attr-defined]
        return report


@pytest.fixture
def run_flat_script(checkpoint: Path, tmp_path: Path) -> Iterator[Callable[[], _Driver]]:
    """Start the flat script as `python script.py` in a fresh folder, like a user would."""
    drivers: list[_Driver] = []

    def start() -> _Driver:
        script = tmp_path / "flat_script.py"
        script.write_text(_FLAT_SCRIPT)
        root = str(Path(__file__).resolve().parents[1])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
        }
        log = tmp_path / "driver.log"
        proc = subprocess.Popen(
            [sys.executable, str(script), str(checkpoint), json.dumps(PROMPTS), str(MAX_TOKENS)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env,
            cwd=tmp_path,
        )  # fmt: skip
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or []], daemon=True).start()
        driver = _Driver(proc, lines, log)
        drivers.append(driver)
        return driver

    yield start
    for d in drivers:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
        for pid in d.worker_pids:  # started (indirectly) by this test
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_flat_script_without_main_guard_runs_at_tp2(
    run_flat_script: Callable[[], _Driver], checkpoint: Path
) -> None:
    driver = run_flat_script()
    report = driver.first_report()
    assert report["tokens"] == hf_greedy(checkpoint, PROMPTS, MAX_TOKENS)
    # Workers are fresh interpreters of the entry module, and the key is nowhere on their command lines.
    key_hex = str(report["key_hex"])
    assert len(driver.worker_pids) == 2
    for cmdline in report["cmdlines"]:  # type: ignore[attr-defined]
        args = cmdline.split("\0")
        assert "tp_runtime.worker.process" in args, args
        assert "spawn_main" not in cmdline and "flat_script" not in cmdline
        assert key_hex not in cmdline and key_hex.upper() not in cmdline
    # Their environment carries no key either.
    for pid in driver.worker_pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert key_hex.encode() not in f.read()
    # The script finishes normally: atexit shuts the engine down and the workers leave.
    assert driver.proc.stdin is not None
    driver.proc.stdin.close()
    assert driver.proc.wait(timeout=60) == 0, driver.log.read_text()
    assert driver.lines.get(timeout=5).strip() == "done"
    assert wait_gone(driver.worker_pids, 10.0) == []
    assert "Traceback" not in driver.log.read_text(), driver.log.read_text()


def test_killing_flat_script_driver_leaves_no_worker(run_flat_script: Callable[[], _Driver]) -> None:
    """The workers see EOF on their stdin pipe and leave at once, removing the ipc socket folder."""
    driver = run_flat_script()
    ipc_dir = Path(str(driver.first_report()["ipc_dir"]))
    assert ipc_dir.is_dir()
    assert all(alive(p) for p in driver.worker_pids)
    os.kill(driver.proc.pid, signal.SIGKILL)
    driver.proc.wait(timeout=10)
    t0 = time.monotonic()
    left = wait_gone(driver.worker_pids, 5.0)
    assert not left, f"workers {left} outlived their driver by {time.monotonic() - t0:.1f} s"
    assert not ipc_dir.exists(), "the ipc folder of the killed driver was left behind"


def test_a_worker_whose_driver_is_already_gone_leaves_with_its_folder(tmp_path: Path) -> None:
    """A worker that asks for the parent-death signal after its driver died (a driver killed just after
    writing the start-up frame) leaves at once, says why, and removes the driver's socket folder."""
    folder = tmp_path / "tp-runtime-x"
    folder.mkdir()
    code = "import sys; from tp_runtime.worker.process import die_with_parent as d; d(0, sys.argv[1])"
    cmd = [sys.executable, "-c", code, str(folder)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "the driver is gone" in proc.stderr, proc.stderr
    assert not folder.exists()


def test_spawn_args_round_trip(checkpoint: Path) -> None:
    """The start-up frame (msgspec msgpack, not pickle) decodes back into an equal EngineConfig: nested
    configs, tuples (rope frequencies, EOS ids) and the key included."""
    model = build_model_config(checkpoint, dtype="float32", device="cpu")
    config = EngineConfig(
        model=model, parallel=ParallelConfig(tensor_parallel_size=2, step_timeout_s=30),
        cache=CacheConfig(num_kv_blocks=64, gpu_memory_utilization=1), seed=3,
    )  # fmt: skip
    args = SpawnArgs(
        config=config, rank=1, local_rank=1, broadcast="ipc:///tmp/x/b", results="ipc:///tmp/x/r",
        heartbeat=None, max_broadcast_bytes=1 << 20, key=os.urandom(32), init_method="file:///tmp/x/s",
        protocol=PROTOCOL,
    )  # fmt: skip
    frame = encode_spawn_args(args)
    r, w = os.pipe()
    try:
        os.write(w, frame + b"trailing bytes stay in the pipe")
        decoded = read_spawn_args(r)
        assert os.read(r, 8) == b"trailing"
    finally:
        os.close(r)
        os.close(w)
    assert decoded == args
    assert decoded.config == config
    assert isinstance(decoded.config.model.rope.inv_freq, tuple)
    assert decoded.config.model.rope == model.rope
    assert isinstance(decoded.config.model.eos_token_ids, tuple)


def test_a_worker_of_other_code_is_refused_at_start(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers whose messages' layout differs from their driver's (another version of the package, or files
    changed since the driver started) exit at once, and LLM() says why, rather than reading every field of
    the driver's msgpack arrays wrongly. The driver here claims another layout; the workers compute theirs."""
    from tp_runtime.executor import multiproc

    monkeypatch.setattr(multiproc, "PROTOCOL", "0" * len(PROTOCOL))
    with pytest.raises(WorkerDiedError, match="driver-worker messages differ from the driver's"):
        LLM(str(checkpoint), tensor_parallel_size=2, device="cpu", dtype="float32")


def test_the_layout_digest_sees_swapped_fields_and_not_docstrings(tmp_path: Path) -> None:
    """messages.PROTOCOL changes when two fields of one type trade places (what decodes silently wrong),
    and not under `python -OO` (docstrings gone) nor with another hash seed."""
    import importlib.util

    source = (Path(__file__).parents[1] / "tp_runtime" / "messages.py").read_text()
    pair = "    temperature: float\n", "    top_p: float\n"
    swapped = source.replace(pair[0] + pair[1], pair[1] + pair[0])
    assert swapped != source
    copy = tmp_path / "swapped_messages.py"
    copy.write_text(swapped)
    spec = importlib.util.spec_from_file_location("swapped_messages", copy)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["swapped_messages"] = module  # msgspec resolves the annotations through it
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["swapped_messages"]
    assert module.PROTOCOL != PROTOCOL
    code = "from tp_runtime.messages import PROTOCOL; print(PROTOCOL)"
    for flags, seed in ((["-OO"], "0"), ([], "12345")):
        out = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})  # fmt: skip
        assert out.stdout.strip() == PROTOCOL, (flags, seed)

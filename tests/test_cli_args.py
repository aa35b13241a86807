"""Arguments checked at the edge: every bad argument is one line, `tp-runtime: error: ...`, with status 2;
`--help` shows every default and the built-in models; under torchrun (scripts/launch_tp.sh) an error or a
Ctrl-C is one line too, with no ChildFailedError report; commands that run once refuse torchrun."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tp_runtime import cli
from tp_runtime.models_catalog import known_names

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tp_runtime.cli", *args],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _one_error_line(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    """Status 2, and the whole output is one line `tp-runtime: error: ...` naming `fragments`."""
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2, f"status {proc.returncode}:\n{output[-3000:]}"
    assert output.startswith("tp-runtime: error: "), output[-3000:]
    assert len(output.splitlines()) == 1, output[-3000:]
    for fragment in fragments:
        assert fragment in output, f"{fragment!r} not in {output!r}"


BAD_ARGUMENTS = [
    (["bench", "latency", "--num-iters", "0"], ["--num-iters", "at least 1", "got 0"]),
    (["bench", "latency", "--batch-size", "0"], ["--batch-size", "at least 1"]),
    (["bench", "latency", "--input-len", "-5"], ["--input-len", "got -5"]),
    (["bench", "latency", "--output-len", "0"], ["--output-len"]),
    (["bench", "latency", "--num-iters-warmup", "-1"], ["--num-iters-warmup", "at least 0"]),
    (["bench", "latency", "--tensor-parallel-size", "0"], ["--tensor-parallel-size"]),
    (["bench", "latency", "--model", "tiny-llama", "--input-len", "2000", "--output-len", "100"],
     ["2100 tokens", "max_model_len=2048"]),
    (["bench", "messaging", "-tp", "0"], ["tensor-parallel-size"]),
    (["bench", "messaging", "--steps", "0"], ["--steps"]),
    (["bench", "messaging", "--num-requests", "0"], ["--num-requests"]),
    (["bench", "messaging", "--spin-wait-us", "-1"], ["--spin-wait-us"]),
    (["generate", "--max-tokens", "0"], ["--max-tokens", "at least 1"]),
    (["generate", "-tp", "0"], ["--tensor-parallel-size"]),
    (["generate", "--max-num-seqs", "0"], ["--max-num-seqs"]),
    (["generate", "--max-model-len", "0"], ["--max-model-len"]),
    (["generate", "--max-num-batched-tokens", "0"], ["--max-num-batched-tokens"]),
    (["generate", "--cpu-kv-cache-gib", "0"], ["--cpu-kv-cache-gib", "must be in (0, 1073741824]"]),
    (["generate", "--cpu-kv-cache-gib", "inf"], ["--cpu-kv-cache-gib", "(0, 1073741824], got inf"]),
    (["generate", "--gpu-memory-utilization", "1.5"], ["--gpu-memory-utilization"]),
    (["generate", "--step-timeout", "0"], ["--step-timeout"]),
    (["generate", "--temperature", "-1"], ["--temperature"]),
    (["generate", "--top-p", "0"], ["--top-p"]),
    (["generate", "--top-k", "-2"], ["--top-k", "-1 or 0 (off)"]),
    (["generate", "--min-p", "2"], ["--min-p"]),
    (["generate", "--seed", "-1"], ["--seed"]),
    (["generate", "--block-size", "3"], ["--block-size", "power of two"]),
    (["generate", "--max-logprobs", "-1"], ["--max-logprobs", "at least 0"]),
    (["generate", "--n", "0"], ["--n", "at least 1", "got 0"]),
    (["generate", "--logprobs", "-1"], ["--logprobs", "at least 0"]),
    (["generate", "--model", "tiny-llama", "--logprobs", "21"], ["--max-logprobs (20)", "got 21"]),
    (["generate", "--model", "tiny-llama", "--chat"], ["--chat", "no chat template"]),
    (["generate", ""], ["prompt 1 is empty"]),
    (["generate", "--output-json", "/nonexistent-folder/out.json"], ["--output-json", "does not exist"]),
    # a folder that exists but takes no new file: refused before the run, not after it
    (["generate", "--output-json", "/proc/out.json"], ["--output-json", "cannot write /proc/out.json"]),
    (["generate", "--model", "no-such-model"], ["'no-such-model'", *known_names()]),
    (["generate", "--model", "llama-3-8b"], ["--load-format dummy"]),
    (["generate", "--model", "tiny-llama", "-tp", "3"], ["tensor_parallel_size=3", "4 attention heads"]),
    (["generate", "--dtype", "float64"], ["invalid choice", "tp-runtime generate --help"]),
    (["generate", "--no-such-flag"], ["unrecognized arguments"]),
    (["bench"], ["required"]),
    ([], ["required"]),
    (["frobnicate"], ["invalid choice"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "fragments"), BAD_ARGUMENTS, ids=[" ".join(a) or "none" for a, _ in BAD_ARGUMENTS]
)
def test_bad_argument_is_one_line_with_status_2(args: list[str], fragments: list[str]) -> None:
    _one_error_line(_cli(*args), *fragments)


def test_make_smollm2_into_a_file_is_one_line(tmp_path: Path) -> None:
    target = tmp_path / "a-file"
    target.write_text("x")
    _one_error_line(_cli("make-smollm2", str(target)), "is a file")


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _subparsers(sub)
    return found


def test_every_flag_has_help_with_its_default() -> None:
    for parser in _subparsers(cli.build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
                continue
            name = f"{parser.prog} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{name} has no help text"
            if action.required or action.default == argparse.SUPPRESS:  # positionals to give; --help
                continue
            shown = formatter._get_help_string(action) or ""  # what --help prints before expansion
            assert "default" in shown, f"{name}: help {shown!r} does not give the default"


def test_help_lists_the_models_and_the_default() -> None:
    for args in (["--help"], ["generate", "--help"], ["bench", "latency", "--help"]):
        proc = _cli(*args)
        assert proc.returncode == 0, proc.stderr
        for name in known_names():
            assert name in proc.stdout, (args, name)
        assert "default is smollm2-135m-instruct" in " ".join(proc.stdout.split()), args
        assert "TP 1,2,4,8" in proc.stdout  # tiny-llama-tp's TP sizes


# ------------------------------------------------------------------------------------------ torchrun


def _launch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "scripts/launch_tp.sh", *args],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _no_torchrun_report(proc: subprocess.CompletedProcess[str]) -> None:
    output = proc.stdout + proc.stderr
    for noise in ("Traceback", "ChildFailedError", "exitcode", "[rank"):
        assert noise not in output, output[-3000:]


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["generate", "--model", "no-such-model"], ["'no-such-model'"]),
        (["generate", "--max-tokens", "0"], ["--max-tokens"]),
        (["generate", "--model", "tiny-llama", "--chat"], ["--chat", "no chat template"]),
        (["bench", "latency", "--num-iters", "0"], ["--num-iters"]),
        (["bench", "messaging"], ["runs once", "without torchrun"]),
        (["make-smollm2", "somewhere"], ["runs once"]),
        # the launcher's own --tensor-parallel-size (NPROC x nodes) had won over it unseen
        (["generate", "--model", "tiny-llama-tp", "-tp", "4"], ["--tensor-parallel-size: 4 is not the 2"]),
        # also an explicit 1 (the default), in any spelling argparse takes
        (["generate", "--model", "tiny-llama-tp", "-tp", "1"], ["--tensor-parallel-size: 1 is not the 2"]),
        (["generate", "--model", "tiny-llama-tp", "--tensor-parallel=1"], ["1 is not the 2"]),
    ],
)
def test_torchrun_argument_error_is_one_line(args: list[str], fragments: list[str]) -> None:
    """Checked once by the launcher, before any rank starts."""
    proc = _launch("2", *args)
    _one_error_line(proc, *fragments)
    _no_torchrun_report(proc)


def test_torchrun_error_inside_the_ranks_is_one_line() -> None:
    """A user error found only once the ranks run (a KV cache too small for one sequence): rank 0 prints
    it, every rank exits 2, and the launcher adds nothing."""
    proc = _launch("2", "generate", "--model", "tiny-llama", "--cpu-kv-cache-gib", "0.00001")
    _one_error_line(proc, "KV cache", "cpu_kv_cache_gib")
    _no_torchrun_report(proc)


def test_torchrun_rendezvous_port_in_use_is_one_line() -> None:
    """A --master-port another process holds: torch's DistNetworkError came out as a ~30-frame traceback."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        rendezvous = f"--nnodes 1 --node-rank 0 --master-addr 127.0.0.1 --master-port {port}"
        proc = subprocess.run(
            ["bash", "scripts/launch_tp.sh", "2", "generate", "--model", "tiny-llama-tp"],
            cwd=REPO, env={**ENV, "TORCHRUN_ARGS": rendezvous}, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    _one_error_line(proc, "torchrun's rendezvous failed", "address already in use", "--master-port")
    _no_torchrun_report(proc)


def test_torchrun_help_prints_once() -> None:
    proc = _launch("2", "generate", "--help")
    assert proc.returncode == 0
    assert proc.stdout.count("usage: tp-runtime generate") == 1


def _interrupt(cmd: list[str], after_s: float) -> tuple[int, str]:
    """Run `cmd` as a terminal would (own process group), press Ctrl-C (SIGINT to the group) after
    `after_s` seconds; returns (status, output)."""
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    time.sleep(after_s)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, output


LONG_BENCH = ["bench", "latency", "--model", "tiny-llama", "--num-iters", "10000", "--no-progress"]


@pytest.mark.slow
@pytest.mark.parametrize("after_s", [1.0, 8.0])
def test_ctrl_c_under_torchrun_prints_one_line(after_s: float) -> None:
    """During start-up (the launcher's checks) and while the ranks run."""
    status, output = _interrupt(["bash", "scripts/launch_tp.sh", "2", *LONG_BENCH], after_s)
    assert status == 130, output[-3000:]
    assert output.strip() == "tp-runtime: interrupted", output[-3000:]


_LAUNCH_INTERRUPTED_IN_IMPORT = """
import os, signal, sys, tempfile, time
from tp_runtime import launch

folder = tempfile.mkdtemp()
with open(os.path.join(folder, "pressing_ctrl_c.py"), "w") as module:  # a Ctrl-C inside an import
    module.write("import os, signal\\nos.kill(os.getpid(), signal.SIGINT)\\n"
                 "total = sum(i * i for i in range(100_000))\\n")
sys.path.insert(0, folder)
last_check = launch._refuse_another_tp_size

def checking(*args, **kwargs):
    last_check(*args, **kwargs)
    import pressing_ctrl_c  # the checks' end: the launcher sees the Ctrl-C before it is sent again

class SlowStderr:  # the held-back signal, sent again once the import is left, lands in the exit's print
    def write(self, text):
        time.sleep(0.5)
        return sys.__stderr__.write(text)

    def flush(self):
        sys.__stderr__.flush()

launch._refuse_another_tp_size = checking
sys.stderr = SlowStderr()
launch.main(["--standalone", "--nproc-per-node", "2", "--", *sys.argv[1:], "--tensor-parallel-size", "2"])
"""


def test_ctrl_c_held_back_in_an_import_ends_the_launcher_with_one_line() -> None:
    """The handler holds a Ctrl-C that comes inside an import back and has it sent again after it; the
    launcher's checks see it first and end, and the signal sent again must not raise a second time in
    that exit (it printed a traceback and ended by SIGINT)."""
    proc = subprocess.run(
        [sys.executable, "-c", _LAUNCH_INTERRUPTED_IN_IMPORT, "generate", "--model", "tiny-llama", "hi"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 130, output[-3000:]
    assert output.strip() == "tp-runtime: interrupted", output[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "after_s"), [(1, 0.5), (1, 6.0), (2, 8.0)])
def test_ctrl_c_prints_one_line(tp: int, after_s: float) -> None:
    """Spawned workers (TP=2) run in sessions of their own, out of reach of the terminal's SIGINT; the
    driver shuts them down and prints one line."""
    status, output = _interrupt(
        [sys.executable, "-m", "tp_runtime.cli", *LONG_BENCH, "-tp", str(tp)], after_s
    )
    # A shell shows 130 for both: CPython ends with SIGINT itself when the KeyboardInterrupt went through
    # C code (an import of torch), whatever status the program chose.
    assert status in (130, -signal.SIGINT), output[-3000:]
    assert output.strip() == "tp-runtime: interrupted", output[-3000:]


_FINALIZER_SIGNAL = """
import os, signal, sys
import tp_runtime.cli as cli
import tp_runtime.engine.args as engine_args

class Probe:
    def __del__(self):  # the signal's handler runs inside this finalizer, which swallows what it raises
        os.kill(os.getpid(), signal.{sig})
        for _ in range(1000):
            pass

def swallowing(original):
    def call(args):
        Probe()
        return original(args)
    return call

if "{where}" == "checks":
    cli.check_model = swallowing(cli.check_model)
else:  # the model's load (generate's, serve's)
    cli.build_llm = swallowing(cli.build_llm)
    engine_args.build_llm = swallowing(engine_args.build_llm)
cli.main(sys.argv[1:])
"""


GENERATE = ["generate", "--model", "tiny-llama", "--max-tokens", "4", "hi"]
SERVE = ["serve", "tiny-llama", "--device", "cpu", "--port", "0"]


@pytest.mark.parametrize(
    ("command", "where", "sig", "status", "last_line"),
    [
        (GENERATE, "checks", "SIGINT", 130, "tp-runtime: interrupted"),
        (GENERATE, "load", "SIGINT", 130, "tp-runtime: interrupted"),
        (SERVE, "load", "SIGTERM", 0, "tp-runtime serve: shut down"),
        (SERVE, "load", "SIGINT", 0, "tp-runtime serve: shut down"),
    ],
)  # fmt: skip
def test_a_signal_swallowed_by_a_finalizer_still_stops_the_command(
    command: list[str], where: str, sig: str, status: int, last_line: str
) -> None:
    """A Ctrl-C (or a server's SIGTERM) whose handler runs inside a finalizer (__del__) is swallowed there
    as "Exception ignored": generate ran to its end with status 0, and serve came up and served. The
    signal is sent from inside a finalizer during the start-up."""
    proc = subprocess.run(
        [sys.executable, "-c", _FINALIZER_SIGNAL.replace("{sig}", sig).replace("{where}", where), *command],
        cwd=REPO,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == status, output[-3000:]
    assert output.strip().splitlines()[-1] == last_line, output[-3000:]
    assert "ready on" not in output and "Exception ignored" not in output and "Traceback" not in output


def _signal_threads_done() -> bool:
    """Wait (an observed event: the threads' end) until no deferred signal is left to send."""
    for thread in [t for t in threading.enumerate() if t.name == "tp-runtime-signal"]:
        thread.join(60)
    return not any(t.name == "tp-runtime-signal" for t in threading.enumerate())


@pytest.fixture
def interrupted_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Import a fresh module whose body presses Ctrl-C `times` times and then runs `then` (code), with
    the CLI's handler installed (put back after the test)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names: list[str] = []

    def run(times: int, then: str = "") -> None:
        name = f"interrupted_module_{len(names)}"
        names.append(name)
        (tmp_path / f"{name}.py").write_text(
            "import os, signal\n"
            f"for _ in range({times}):\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    total = sum(i * i for i in range(100_000))  # many bytecodes, where a handler would raise\n"
            f"{then}\n"
            "FINISHED = True\n"
        )
        importlib.import_module(name)

    yield run
    handler = signal.getsignal(signal.SIGINT)
    if isinstance(handler, cli._InterruptsOutsideImports):  # nothing held is sent after the test
        handler.stop()
    assert _signal_threads_done()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in names:
        sys.modules.pop(name, None)


def test_a_ctrl_c_inside_an_import_is_raised_when_the_import_ends(
    interrupted_import: Callable[..., None],
) -> None:
    """A KeyboardInterrupt raised inside an extension module's C++ set-up (torch's, through pybind11)
    aborts the process: the CLI's handler lets an import finish first, and raises outside any import, as
    a real signal, which also wakes a blocking wait (the previous redelivery did not: it ran its course)."""
    signal.signal(signal.SIGINT, cli._InterruptsOutsideImports())
    after_import = False
    waited = 0.0
    with pytest.raises(KeyboardInterrupt):
        interrupted_import(1)
        after_import = True
        start = time.monotonic()
        try:
            threading.Event().wait(120)
        finally:
            waited = time.monotonic() - start
    assert after_import and waited < 60


def test_ctrl_cs_inside_one_import_are_raised_once(interrupted_import: Callable[..., None]) -> None:
    signal.signal(signal.SIGINT, cli._InterruptsOutsideImports())
    raised = 0
    try:
        interrupted_import(3)
    except KeyboardInterrupt:
        raised += 1
    while True:
        try:
            done = _signal_threads_done()
            sum(i for i in range(100_000))  # where a signal sent since would be handled
            if done:
                break
        except KeyboardInterrupt:
            raised += 1
    assert raised == 1


def test_a_ctrl_c_held_when_the_command_ends_is_dropped(
    interrupted_import: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """main returns (stops the handler, then puts the default one back) while an import's Ctrl-C is
    still held: it is not sent to main's caller afterwards."""
    interrupts = cli._InterruptsOutsideImports()
    signal.signal(signal.SIGINT, interrupts)
    monkeypatch.setattr(sys, "tp_runtime_test_stop", interrupts.stop, raising=False)
    interrupted_import(1, then="import sys; sys.tp_runtime_test_stop()")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    assert _signal_threads_done()
    sum(i for i in range(100_000))  # where a signal sent since would be raised


def test_a_ctrl_c_swallowed_by_a_finalizer_wakes_a_blocking_wait() -> None:
    """It is sent again as a real signal: _thread.interrupt_main, as before, left an Event().wait to
    run its course."""

    class Probe:
        def __del__(self) -> None:  # the handler's KeyboardInterrupt is swallowed here
            os.kill(os.getpid(), signal.SIGINT)
            sum(i for i in range(100_000))

    previous_hook = cli._redeliver_interrupts_from_finalizers()
    signal.signal(signal.SIGINT, cli._InterruptsOutsideImports())
    waited = 0.0
    try:
        with pytest.raises(KeyboardInterrupt):
            Probe()
            start = time.monotonic()
            try:
                threading.Event().wait(120)
            finally:
                waited = time.monotonic() - start
    finally:
        sys.unraisablehook = previous_hook
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert waited < 60


def test_a_ctrl_c_outside_imports_is_raised_at_once() -> None:
    previous = signal.signal(signal.SIGINT, cli._InterruptsOutsideImports())
    reached = False
    try:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            sum(i for i in range(200_000))  # the handler runs between these bytecodes
            reached = True
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not reached


_CTRL_C_IN_AN_IMPORT = """
import importlib.abc, os, signal, sys

module, looked_for = sys.argv[1], sys.argv[2]

class CtrlCHalfWay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # `module`'s body is running: it imports `looked_for`
        if name == looked_for:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlCHalfWay())
import tp_runtime.cli as cli
try:
    cli.main(sys.argv[3:])
finally:
    print("imported:", module in sys.modules, flush=True)
"""


@pytest.mark.parametrize(
    ("module", "looked_for", "command", "status", "last_line"),
    [
        # the checks (resolve_device) import torch, before any engine: the CLI's handler
        ("torch", "torch._C", GENERATE, 130, "tp-runtime: interrupted"),
        # the model's load imports zmq: the server's handler, which drains
        ("zmq", "zmq", SERVE, 0, "tp-runtime serve: shut down"),
    ],
)  # fmt: skip
def test_a_ctrl_c_during_an_import_of_the_command_waits_for_it(
    module: str, looked_for: str, command: list[str], status: int, last_line: str
) -> None:
    """A Ctrl-C half-way through an import is acted on after the import, which completes, and the
    command still ends as a Ctrl-C ends it."""
    proc = subprocess.run(
        [sys.executable, "-c", _CTRL_C_IN_AN_IMPORT, module, looked_for, *command],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == status, output[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "imported: True", output[-3000:]
    assert last_line in output.splitlines() and "Traceback" not in output, output[-3000:]


def test_output_json_check_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    """The check opens the file as the command will write it, and leaves no trace: an existing file keeps
    its contents, a new one is not left behind."""
    kept = tmp_path / "kept.json"
    kept.write_text('{"earlier": 1}')
    assert cli.check_output_json(str(kept)) == str(kept) and kept.read_text() == '{"earlier": 1}'
    fresh = tmp_path / "fresh.json"
    assert cli.check_output_json(str(fresh)) == str(fresh) and not fresh.exists()


def test_a_torchrun_rank_above_0_names_itself_in_its_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its arguments were checked on its own node: its error must reach the user, not be left to rank 0."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as info:
        cli.fail("argument --output-json: folder /x does not exist")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == "tp-runtime: error: rank 1: argument --output-json: folder /x does not exist\n", err


def test_an_unbounded_drain_gives_torchrun_a_finite_shutdown_timeout() -> None:
    from tp_runtime.launch import shutdown_timeout_s

    assert shutdown_timeout_s(30.0) == 45 and shutdown_timeout_s(0.5) == 16
    assert 365 * 24 * 3600 < shutdown_timeout_s(float("inf")) < 366 * 24 * 3600


def test_output_json_check_opens_no_fifo_nor_device(tmp_path: Path) -> None:
    """A FIFO (opening it for writing would wait for a reader) and /dev/stdout pass as they are."""
    fifo = tmp_path / "results.fifo"
    os.mkfifo(fifo)
    assert cli.check_output_json(str(fifo)) == str(fifo)
    assert cli.check_output_json("/dev/stdout") == "/dev/stdout"


def test_output_json_check_through_a_dangling_symlink_leaves_it_be(tmp_path: Path) -> None:
    """A symlink to a file not made yet stays a symlink, and nothing is made at its target by the check."""
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "target.json")
    assert cli.check_output_json(str(link)) == str(link)
    assert link.is_symlink() and not (tmp_path / "target.json").exists()


def test_output_json_checks_of_one_path_at_once_both_pass(tmp_path: Path) -> None:
    """Two commands checking one new path at the same time (torchrun nodes sharing a folder) both pass, and
    the check leaves nothing behind: it made and removed a file of its own name (a probe named as the
    target refused the second with "File exists")."""
    import threading

    target, errors = tmp_path / "out.json", []

    def check() -> None:
        for _ in range(200):
            try:
                cli.check_output_json(str(target))
            except Exception as exc:  # collected for the assertion
                errors.append(exc)

    threads = [threading.Thread(target=check) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and list(tmp_path.iterdir()) == []

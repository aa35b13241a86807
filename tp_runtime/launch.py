"""torchrun for `tp-runtime` commands, as scripts/launch_tp.sh runs it:

    python -m tp_runtime.launch [TORCHRUN_ARGS...] -- COMMAND [ARGS...]

It is torchrun (`torch.distributed.run`, same arguments) with the user's view of errors:

- The command's arguments are checked here once, before any rank starts: a bad argument, an unknown
  model or a TP size the model cannot run at is one line, `tp-runtime: error: ...`, with status 2, and
  `--help` prints the help once. A built-in model is written into the cache here, not by every rank.
- A rank that stops on a user error (status 2, which only rank 0 reports) or on Ctrl-C (130) ends the
  job with that status and without torchrun's ChildFailedError report; Ctrl-C prints one line. Any
  other failure ends with one line naming the rank and its status, after that rank's own output.
- torchrun's per-job log folder is a temporary folder removed at the end (unless --log-dir is given).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
from typing import Any

from tp_runtime import cli
from tp_runtime.config import MAX_TIMEOUT_S
from tp_runtime.interrupts import DeferredSignals, in_import

_QUIET_STATUSES = (cli.EXIT_USAGE, cli.EXIT_INTERRUPTED)
# Past serve's drain, before torchrun's SIGKILL: time for the server to shut its workers down and exit.
_SHUTDOWN_SLACK_S = 15
# What each rank runs: `python -m tp_runtime.cli`, but first (1) SIGINT, which torchrun forwards to every
# rank on Ctrl-C, ends the rank at once and quietly (this launcher reports it), and (2) on Linux the rank
# ends when its launcher does (PR_SET_PDEATHSIG), even a launcher killed outright.
_RANK_MAIN = """\
import os, signal, sys
signal.signal(signal.SIGINT, lambda *_: os._exit(130))
if sys.platform.startswith("linux"):
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
import runpy
runpy.run_module("tp_runtime.cli", run_name="__main__", alter_sys=True)
"""


class _QuietFailures(logging.Filter):
    """Drops torchrun's log lines about a job that ends on a user error or Ctrl-C (reported already)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "closing signal" in message or "death signal" in message:
            return False
        return not any(f"(exitcode: {status})" in message for status in _QUIET_STATUSES)


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        cli.fail("usage: python -m tp_runtime.launch [TORCHRUN_ARGS...] -- COMMAND [ARGS...]")
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


class _Interrupts:
    """This process's SIGINT handler until torchrun's agent installs its own, which it does before it
    starts any rank (and which then stops the ranks it started). A Ctrl-C here therefore finds no rank to
    stop: during the checks it raises KeyboardInterrupt (and is remembered, in case a library swallows
    it); once torchrun is being set up it ends the process at once. KeyboardInterrupt is raised once: a
    second one (a Ctrl-C held back in an import and sent again, or pressed twice) would land in the
    launcher's own exit."""

    def __init__(self) -> None:
        self.seen = False
        self.raised = False  # a KeyboardInterrupt is on its way (the launcher checks `seen` besides)
        self.torchrun_log_dir: str | None = None
        self.in_torchrun = False
        self.deferred = DeferredSignals()  # one that came inside an import (torch's), sent again after it

    def __call__(self, signum: int, frame: Any) -> None:
        self.deferred.arrived(signum)
        self.seen = True
        if not self.in_torchrun:
            if in_import(frame):
                self.deferred.defer(signum)
                return
            if not self.raised:
                self.raised = True
                raise KeyboardInterrupt
            return
        if self.torchrun_log_dir is not None:
            shutil.rmtree(self.torchrun_log_dir, ignore_errors=True)
        with contextlib.suppress(Exception):
            print(f"{cli.PROG}: interrupted", file=sys.stderr, flush=True)
        os._exit(cli.EXIT_INTERRUPTED)


def _quiet_interrupts_in_finalizers(interrupts: _Interrupts) -> None:
    """A Ctrl-C that lands in a finalizer (__del__) is printed as "Exception ignored" and swallowed;
    _Interrupts remembers it, so drop the report. After a Ctrl-C, so are the errors of finalizers that
    the teardown runs (torch's elastic agent has one that joins its own thread)."""
    default = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt) and not interrupts.seen:
            default(unraisable)

    sys.unraisablehook = hook


def _names_tp_flag(word: str) -> bool:
    """Whether a command-line word gives -tp/--tensor-parallel-size (also as `=value`, `-tpN`, or a prefix
    of the long name, which argparse takes)."""
    name = word.split("=", 1)[0]
    return name.startswith("-tp") or (len(name) > 3 and "--tensor-parallel-size".startswith(name))


def _refuse_another_tp_size(command_argv: list[str], command: Any) -> None:
    """launch_tp.sh gives the command --tensor-parallel-size NPROC x nodes, after the user's arguments: one
    the user gave as well, and otherwise, lost to it unseen (`-tp 4` ran at TP 2): a user error."""
    given = getattr(command, "tensor_parallel_size", None)
    words = command_argv[: command_argv.index("--")] if "--" in command_argv else command_argv
    last = max((i for i, w in enumerate(words[:-1]) if w == "--tensor-parallel-size"), default=None)
    if given is None or last is None:
        return
    own = command_argv[:last] + command_argv[last + 2 :]
    users = cli.build_parser().parse_args(own)
    said = any(_names_tp_flag(w) for w in (own[: own.index("--")] if "--" in own else own))
    if users.tensor_parallel_size != given and (said or users.tensor_parallel_size != 1):
        cli.fail(
            f"argument -tp/--tensor-parallel-size: {users.tensor_parallel_size} is not the {given} ranks "
            f"torchrun starts (NPROC x nodes); leave it out, or start {users.tensor_parallel_size} ranks"
        )


def main(argv: list[str] | None = None) -> None:
    torchrun_argv, command_argv = _split(sys.argv[1:] if argv is None else argv)
    interrupts = _Interrupts()
    signal.signal(signal.SIGINT, interrupts)
    _quiet_interrupts_in_finalizers(interrupts)
    try:
        once = cli.once_only_command(command_argv)
        if once is not None:  # before parsing: launch_tp.sh adds --tensor-parallel-size, which it lacks
            cli.refuse_once_only(once)
        command = cli.parse_and_check(command_argv, under_torchrun=True)
        _refuse_another_tp_size(command_argv, command)
        if interrupts.seen:
            interrupts.raised = True
            raise KeyboardInterrupt
        status = _run_torchrun(torchrun_argv, command_argv, interrupts, _drain_s(command))
    except KeyboardInterrupt:
        status = cli.EXIT_INTERRUPTED
    if status == cli.EXIT_INTERRUPTED:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # one line, however often Ctrl-C comes now
        print(f"{cli.PROG}: interrupted", file=sys.stderr, flush=True)
        # Not SystemExit: CPython ends with SIGINT instead of the status when the KeyboardInterrupt went
        # through C code (an import of torch); nothing is left to clean up here.
        sys.stdout.flush()
        os._exit(status)
    raise SystemExit(status)


def _stop_ranks_with_sigterm_on_ctrl_c(interrupts: _Interrupts) -> None:
    """torchrun's agent passes the signal it got on to every rank. For Ctrl-C, pass SIGTERM instead: it
    ends a rank silently at any point, even while its interpreter starts (a SIGINT there would print a
    KeyboardInterrupt traceback). The agent's handler is looked up by name when it installs it."""
    from torch.distributed.elastic.multiprocessing import api

    original = getattr(api, "_terminate_process_handler", None)
    if original is None or not hasattr(api, "SignalException"):  # another torch: keep its behaviour
        return

    def handler(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            interrupts.seen = True
            raise api.SignalException(f"Process {os.getpid()} got signal: SIGINT", sigval=signal.SIGTERM)
        original(signum, frame)

    api._terminate_process_handler = handler


def _drain_s(command: Any) -> float | None:
    """How long `serve` may drain after SIGTERM (its grace and the margin for the last responses); None
    for the other commands."""
    if getattr(command, "command", None) != "serve":
        return None
    from tp_runtime.server.runner import DRAIN_MARGIN_S

    return float(command.shutdown_grace) + DRAIN_MARGIN_S


def shutdown_timeout_s(drain_s: float) -> int:
    """torchrun's --shutdown-timeout for `serve --shutdown-grace drain_s`: torchrun SIGKILLs the ranks this
    long after passing a SIGTERM on (30 s by default), so `serve` is given its drain and then the time to
    shut its workers down (an unbounded drain: as long as a timeout may be)."""
    return math.ceil(min(drain_s, MAX_TIMEOUT_S)) + _SHUTDOWN_SLACK_S


def _run_torchrun(
    torchrun_argv: list[str], command_argv: list[str], interrupts: _Interrupts, drain_s: float | None
) -> int:
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    for name in (
        "torch.distributed.elastic.multiprocessing.api",
        "torch.distributed.elastic.agent.server.api",
    ):
        logging.getLogger(name).addFilter(_QuietFailures())
    log_dir = None
    try:
        if not any(a == "--log-dir" or a.startswith(("--log-dir=", "--log_dir")) for a in torchrun_argv):
            log_dir = tempfile.mkdtemp(prefix="tp-runtime-torchrun-")
            interrupts.torchrun_log_dir = log_dir
            torchrun_argv = [*torchrun_argv, "--log-dir", log_dir]
        # The command's own arguments bypass torchrun's parser, which would take `--n` for an abbreviation of
        # one of its flags (argparse matches prefixes anywhere in the argument list).
        args = parse_args([*torchrun_argv, "--no-python", sys.executable, "-u", "-c", _RANK_MAIN])
        args.training_script_args = [*args.training_script_args, *command_argv]
        timeout_given = args.shutdown_timeout is not None or "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in os.environ
        if drain_s is not None and not timeout_given:
            args.shutdown_timeout = shutdown_timeout_s(drain_s)
        nproc = str(args.nproc_per_node)
        if "OMP_NUM_THREADS" not in os.environ and nproc.isdigit() and int(nproc) > 1:
            # What torchrun does then, without its banner about it.
            os.environ["OMP_NUM_THREADS"] = "1"
        os.environ[cli.LAUNCHED_ENV] = "1"  # the ranks leave Ctrl-C to this process
        _stop_ranks_with_sigterm_on_ctrl_c(interrupts)
        interrupts.in_torchrun = True
        if interrupts.seen:  # one that came in the imports above, or was swallowed there
            return cli.EXIT_INTERRUPTED
        try:
            run(args)
            return 0
        except SignalException as exc:
            return cli.EXIT_INTERRUPTED if interrupts.seen else 128 + int(exc.sigval)
        except (DistError, RendezvousError) as exc:  # its store: a port in use, a host not reached
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            detail = lines[0] if lines else type(exc).__name__
            print(
                f"{cli.PROG}: error: torchrun's rendezvous failed ({detail}); check the "
                "--master-addr and --master-port given in TORCHRUN_ARGS",
                file=sys.stderr,
                flush=True,
            )
            return cli.EXIT_USAGE
        except ChildFailedError as exc:
            rank, failure = exc.get_first_failure()
            status = failure.exitcode
            if status in _QUIET_STATUSES:
                return status
            if status < 0:
                try:
                    how = f"was killed by {signal.Signals(-status).name}"
                except ValueError:
                    how = f"was killed by signal {-status}"
                status = 128 - status
            else:
                how = f"exited with status {status}"
            print(f"{cli.PROG}: error: rank {rank} {how}", file=sys.stderr, flush=True)
            return status or 1
    finally:
        if log_dir is not None:
            shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    main()

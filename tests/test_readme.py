"""The README runs as written, in a shell whose PATH does not hold the virtualenv.

- Every ```bash and ```python block runs verbatim (bash blocks with `bash -euo pipefail`, python blocks as
  a script file), except the first block, the set-up and the test suite, which the second test runs.
- The README's first two commands run in a fresh clone of this checkout: the set-up and the main command,
  then `scripts/test.sh -k` on a handful of tests, the torchrun ones among them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# What the clone's `scripts/test.sh -k` runs: the CLI end to end, torchrun on one and two "nodes", the
# launcher's one-line errors, and the README's main command.
CLONE_TESTS = (
    "test_generate_matches_hf or test_torchrun_two_nodes_on_one_host or test_launch_script_usage_error "
    "or test_readme_main_command_completes_paris or test_torchrun_argument_error_is_one_line "
    "or test_bad_argument_is_one_line_with_status_2"
)


def code_blocks() -> list[tuple[str, str]]:
    """(language, code) of every ```bash and ```python block, in README order."""
    return re.findall(r"^```(bash|python)\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def user_env() -> dict[str, str]:
    """This environment as a new user's shell has it: no virtualenv active, none on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    keep = [p for p in env.get("PATH", "").split(os.pathsep) if p and not (Path(p) / "activate").exists()]
    env["PATH"] = os.pathsep.join(keep)
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _first_block() -> str:
    lang, code = code_blocks()[0]
    assert lang == "bash" and "scripts/setup.sh" in code and "scripts/test.sh" in code, code
    return code


BLOCKS = code_blocks()[1:]


def test_readme_has_the_examples() -> None:
    langs = [lang for lang, _ in BLOCKS]
    assert "python" in langs and "bash" in langs
    python = next(code for lang, code in BLOCKS if lang == "python")
    # A flat script, as vLLM's examples are: no `if __name__ == "__main__":` guard, even at TP=2.
    assert "__main__" not in python and "tensor_parallel_size=2" in python


@pytest.mark.slow
@pytest.mark.parametrize(
    ("lang", "code"), BLOCKS, ids=[f"{i + 2}-{lang}" for i, (lang, _) in enumerate(BLOCKS)]
)
def test_readme_block_runs(lang: str, code: str, tmp_path: Path) -> None:
    """Each block in a folder of its own that looks like the checkout (`.venv`, `scripts`), so the files a
    block writes land there."""
    for name in (".venv", "scripts"):
        if (REPO / name).exists():
            (tmp_path / name).symlink_to(REPO / name)
    env = user_env()
    if lang == "bash":
        script = tmp_path / "block.sh"
        script.write_text(code)
        cmd = ["bash", "-euo", "pipefail", str(script)]
    else:
        script = tmp_path / "example.py"
        script.write_text(code)
        venv_python = REPO / ".venv" / "bin" / "python"
        cmd = [str(venv_python if venv_python.exists() else Path(sys.executable)), str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{lang} block failed:\n{code}\n--- output:\n{output[-4000:]}"
    assert "Traceback" not in output, output[-4000:]
    if lang == "python":
        assert len(proc.stdout.strip().splitlines()) == 2, proc.stdout  # one line per prompt


def _fresh_clone(target: Path) -> None:
    """A clone of this checkout plus its uncommitted changes (none when CI runs on a commit)."""
    subprocess.run(["git", "clone", "-q", str(REPO), str(target)], check=True)
    diff = subprocess.run(
        ["git", "-C", str(REPO), "diff", "HEAD", "--binary"], check=True, capture_output=True
    ).stdout
    if diff:
        subprocess.run(["git", "-C", str(target), "apply", "--binary", "-"], input=diff, check=True)
    untracked = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "--others", "--exclude-standard", "-z"],
        check=True, capture_output=True, text=True,
    ).stdout.split("\0")  # fmt: skip
    for name in filter(None, untracked):
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target / name)


@pytest.mark.slow
def test_readme_first_two_commands_in_a_fresh_clone(tmp_path: Path) -> None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout")
    assert _first_block().strip().splitlines()[1] == "bash scripts/test.sh"
    if os.environ.get("TP_RUNTIME_README_COMMANDS_RAN_HERE") == "1":
        # .ci/run: this checkout is CI's fresh clone, which ran the first command and its checks, and is
        # running the second one now; a second clone would only repeat both.
        pytest.skip(".ci/run ran the README's two commands in this fresh clone")
    clone = tmp_path / "clone"
    try:
        _run_first_two_commands(clone)
    finally:
        shutil.rmtree(clone, ignore_errors=True)  # its .venv is 2.5 GB


def _run_first_two_commands(clone: Path) -> None:
    setup_and_main, test_command = _first_block().strip().splitlines()
    _fresh_clone(clone)
    env = user_env()
    env.pop("PYTHONPATH", None)  # the clone's own package, from its own .venv

    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", setup_and_main],
        cwd=clone, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "'The capital of France is' -> ' Paris" in proc.stdout, proc.stdout[-3000:]
    # The main command's set-up leaves the test tools out.
    for tool in ("pytest", "ruff", "mypy"):
        assert not (clone / ".venv" / "bin" / tool).exists(), f"setup.sh installed {tool}"
    # triton is a test tool with torch's CPU build; the CUDA build (set-up's fallback) depends on it.
    cpu_build = list((clone / ".venv").glob("lib/python*/site-packages/torch-*+cpu.dist-info"))
    if cpu_build:
        triton = list((clone / ".venv").glob("lib/python*/site-packages/triton"))
        assert not triton, "setup.sh installed triton"

    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", f"{test_command} -k '{CLONE_TESTS}' -p no:cacheprovider"],
        cwd=clone, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    tail = proc.stdout[-5000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    summary = proc.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 5, tail
    assert "failed" not in summary and "error" not in summary and "skipped" not in summary, tail

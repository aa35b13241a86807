#!/usr/bin/env bash
# Set up (idempotently, with the test tools: scripts/setup.sh --test) and run the test suite. Extra
# arguments go to pytest, e.g. `-m "not slow"` or `-k torchrun`. Needs no activated virtualenv.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh --test
venv=${VIRTUAL_ENV:-$(pwd)/.venv}
# No model hub is reachable; make any accidental hub lookup fail fast instead of hanging.
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
# exec: pytest's exit status is the script's, including 5 when no test was collected.
exec "$venv/bin/python" -m pytest -q tests "$@"

#!/usr/bin/env bash
# Run a tp-runtime command under torchrun with NPROC ranks on this host:
#   scripts/launch_tp.sh NPROC generate --model PATH "prompt"
#   scripts/launch_tp.sh NPROC bench latency --model llama-3-8b --load-format dummy
# Rank 0 hosts the driver (engine, scheduler, output); ranks 1..NPROC-1 are workers that connect to it.
# --tensor-parallel-size NPROC is appended for you. Across hosts, set TORCHRUN_ARGS to torchrun's
# multi-node flags (then NPROC is the processes per node and the TP size is NPROC * nodes), e.g. on each node:
#   TORCHRUN_ARGS="--nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500" \
#     scripts/launch_tp.sh 8 bench latency --model llama-3-70b --load-format dummy
#
# torchrun runs as `python -m tp_runtime.launch` (torch.distributed.run underneath) with the project's
# Python: the active virtualenv's, else ./.venv's (made by scripts/setup.sh), else python3. No activated
# venv or PATH entry is needed.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 NPROC COMMAND [ARGS...]   (COMMAND: generate | bench latency)" >&2
  exit 2
fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=python3
for candidate in "${VIRTUAL_ENV:-}/bin/python" "$root/.venv/bin/python"; do
  if [[ $candidate != /bin/python && -x $candidate ]]; then
    py=$candidate
    break
  fi
done
nproc=$1
shift
# NPROC goes into shell arithmetic below: anything but a positive count would be a bash error there.
if ! [[ $nproc =~ ^[1-9][0-9]*$ ]]; then
  echo "tp-runtime: error: NPROC must be a positive number of processes, got '$nproc'; usage: $0 NPROC COMMAND [ARGS...]" >&2
  exit 2
fi
# shellcheck disable=SC2206
torchrun_args=(${TORCHRUN_ARGS:---standalone})
nnodes=1
for ((i = 0; i < ${#torchrun_args[@]}; i++)); do
  case "${torchrun_args[$i]}" in
    --nnodes) nnodes=${torchrun_args[$((i + 1))]:-} ;;
    --nnodes=*) nnodes=${torchrun_args[$i]#--nnodes=} ;;
  esac
done
if ! [[ $nnodes =~ ^[1-9][0-9]*$ ]]; then
  echo "tp-runtime: error: TORCHRUN_ARGS' --nnodes must be a number of nodes (not a range) for the TP size, got '$nnodes'" >&2
  exit 2
fi
# --tensor-parallel-size goes before a `--` in the command's arguments (which makes the words after it
# prompts, e.g. one that begins with "-"): appended after it, it would be two more prompts.
command_args=()
tp_flag=(--tensor-parallel-size "$((nproc * nnodes))")
for arg in "$@"; do
  if [[ $arg == -- && ${#tp_flag[@]} -gt 0 ]]; then
    command_args+=("${tp_flag[@]}")
    tp_flag=()
  fi
  command_args+=("$arg")
done
# (empty after a `--`: the +-form, as bash before 4.4 takes an empty array for unset under set -u)
command_args+=(${tp_flag[@]+"${tp_flag[@]}"})
# tp_runtime.launch is torchrun that checks the command's arguments once before starting the ranks and
# reports a user error or Ctrl-C in one line (no ChildFailedError report).
exec "$py" -m tp_runtime.launch "${torchrun_args[@]}" --nproc-per-node "$nproc" -- "${command_args[@]}"

#!/usr/bin/env bash
# The GPU measurements recorded in BENCHMARKS.md (run on the device machines; see the device README).
#   scripts/gpu_bench.sh smoke|checks|rows|rows1|rows8b|serve|traffic|throughput|fresh|prefix|structured|fp8|kvfp8|families|compare|compare1|tp1|tp2|fused|profile|profile2|matmuls|messaging|peer OUT_DIR
set -euo pipefail
part=$1
out=${2:-/tmp/tp-runtime-bench}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
py=${PYTHON:-python3}
bench() {  # name, then bench latency args
  local name=$1
  shift
  $py -m tp_runtime.cli bench latency --load-format dummy --dtype bfloat16 --no-progress \
    --output-json "$out/$name.json" "$@" 2>&1 | grep -v Warning | tail -24 | tee "$out/$name.txt"
}
wait_healthy() {  # port, server pid, server log: until /health says 200 (or the server died: its log, exit)
  for _ in $(seq 1200); do
    $py -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$1/health', timeout=5)" 2>/dev/null \
      && return 0
    kill -0 "$2" 2>/dev/null || { tail -20 "$3"; exit 1; }
    sleep 0.5
  done
  echo "server on port $1 not healthy after 10 min" >&2
  exit 1
}
case $part in
  checks)  # kernels, engine vs HF, all-reduce sums, TP=2 vs TP=1 with split-KV on and off (nvidia-h200-x2)
    $py scripts/gpu_check.py --out "$out/gpu_check.json" 2>&1 | grep -E "^ok|^FAIL|passed|Error" || true
    $py -m torch.distributed.run --standalone --nproc-per-node 2 scripts/check_all_reduce.py \
      --out "$out/all_reduce.json" 2>&1 | grep -v Warning | tail -30 || true
    $py scripts/compare_tp.py --model llama-3-8b --load-format dummy --dtype float32 --tp-sizes 1 2 \
      --attention-backends triton triton_one_split --num-prompts 4 --input-len 300 --max-tokens 24 \
      --output-json "$out/compare_split.json" 2>&1 | grep -E "identical|model=|Error" || true
    bench tp2_b1_nccl --model llama-3-8b -tp 2 --batch-size 1 --input-len 32 --output-len 128 --num-iters 3 \
      --all-reduce nccl
    ;;
  rows1)  # the TP=1 latency rows (one GPU) with HF static as the peer
    common=(--num-iters-warmup 1)
    bench tp1_b32 --model llama-3-8b --batch-size 32 --input-len 1000 --output-len 128 --num-iters 3 "${common[@]}"
    bench tp1_b1 --model llama-3-8b --batch-size 1 --input-len 32 --output-len 128 --num-iters 5 "${common[@]}"
    $py scripts/bench_hf_peer.py --model llama-3-8b --batch-size 32 --input-len 1000 --output-len 128 \
      --cache-implementation static --output-json "$out/hf_static_b32.json"
    $py scripts/bench_hf_peer.py --model llama-3-8b --batch-size 1 --input-len 32 --output-len 128 \
      --cache-implementation static --num-iters 5 --output-json "$out/hf_static_b1.json"
    ;;
  rows8b)  # the rows below without the 70B one
    common=(--num-iters-warmup 1)
    bench tp1_b32 --model llama-3-8b --batch-size 32 --input-len 1000 --output-len 128 --num-iters 3 "${common[@]}"
    bench tp2_b32 --model llama-3-8b -tp 2 --batch-size 32 --input-len 1000 --output-len 128 --num-iters 3 "${common[@]}"
    bench tp1_b1 --model llama-3-8b --batch-size 1 --input-len 32 --output-len 128 --num-iters 5 "${common[@]}"
    bench tp2_b1 --model llama-3-8b -tp 2 --batch-size 1 --input-len 32 --output-len 128 --num-iters 5 "${common[@]}"
    $py scripts/bench_hf_peer.py --model llama-3-8b --batch-size 32 --input-len 1000 --output-len 128 \
      --cache-implementation static --output-json "$out/hf_static_b32.json"
    $py scripts/bench_hf_peer.py --model llama-3-8b --batch-size 1 --input-len 32 --output-len 128 \
      --cache-implementation static --num-iters 5 --output-json "$out/hf_static_b1.json"
    ;;
  rows)  # the decode-step table of BENCHMARKS.md, with HF transformers' static cache as the peer (x2)
    common=(--num-iters-warmup 1)
    bench tp1_b32 --model llama-3-8b --batch-size 32 --input-len 1000 --output-len 128 --num-iters 3 "${common[@]}"
    bench tp2_b32 --model llama-3-8b -tp 2 --batch-size 32 --input-len 1000 --output-len 128 --num-iters 3 "${common[@]}"
    bench tp1_b1 --model llama-3-8b --batch-size 1 --input-len 32 --output-len 128 --num-iters 5 "${common[@]}"
    bench tp2_b1 --model llama-3-8b -tp 2 --batch-size 1 --input-len 32 --output-len 128 --num-iters 5 "${common[@]}"
    bench tp2_70b_b1 --model llama-3-70b -tp 2 --batch-size 1 --input-len 32 --output-len 128 --num-iters 3 \
      "${common[@]}"
    $py scripts/bench_hf_peer.py --model llama-3-8b --batch-size 32 --input-len 1000 --output-len 128 \
      --cache-implementation static --output-json "$out/hf_static_b32.json"
    $py scripts/bench_hf_peer.py --model llama-3-8b --batch-size 1 --input-len 32 --output-len 128 \
      --cache-implementation static --num-iters 5 --output-json "$out/hf_static_b1.json"
    ;;
  smoke)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $py -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
    $py scripts/compare_tp.py --model tiny-llama-tp --tp-sizes 1 2 --num-prompts 4 --max-tokens 16
    bench tiny_tp2 --model tiny-llama-tp -tp 2 --batch-size 8 --output-len 32 --num-iters 2
    ;;
  compare)
    for dtype in float32 bfloat16; do
      $py scripts/compare_tp.py --model llama-3-8b --load-format dummy --dtype $dtype --tp-sizes 1 2 \
        --num-prompts 8 --input-len 64 --max-tokens 32 --output-json "$out/compare_$dtype.json"
    done
    ;;
  compare1)  # one GPU: async scheduling on vs off must give the same tokens
    $py scripts/compare_tp.py --model llama-3-8b --load-format dummy --dtype float32 --tp-sizes 1 \
      --async-scheduling both --num-prompts 8 --input-len 64 --max-tokens 32 --output-json "$out/compare_async.json"
    ;;
  tp1 | tp2)
    tp=${part#tp}
    b32=(--model llama-3-8b -tp "$tp" --batch-size 32 --input-len 1000 --output-len 128 --num-iters-warmup 1
      --num-iters 3)
    b1=(--model llama-3-8b -tp "$tp" --batch-size 1 --input-len 32 --output-len 128 --num-iters-warmup 1
      --num-iters 5)
    bench "llama3_8b_tp${tp}_b32_async" "${b32[@]}"
    bench "llama3_8b_tp${tp}_b32_sync_overlap" "${b32[@]}" --no-async-scheduling
    bench "llama3_8b_tp${tp}_b32_sync_first" "${b32[@]}" --no-async-scheduling --bookkeeping-order sync_first
    bench "llama3_8b_tp${tp}_b1_async" "${b1[@]}"
    bench "llama3_8b_tp${tp}_b1_sync" "${b1[@]}" --no-async-scheduling
    ;;
  fused)  # fused Triton kernels (default on CUDA) against PyTorch ops, back to back
    for kernels in auto torch; do
      bench "llama3_8b_b32_kernels_$kernels" --model llama-3-8b --batch-size 32 --input-len 1000 --output-len 128 \
        --num-iters-warmup 1 --num-iters 3 --fused-kernels $kernels
      bench "llama3_8b_b1_kernels_$kernels" --model llama-3-8b --batch-size 1 --input-len 32 --output-len 128 \
        --num-iters-warmup 1 --num-iters 5 --fused-kernels $kernels
    done
    ;;
  profile)  # top device kernels of decode steps (bench latency samples at temperature 1)
    $py scripts/profile_decode.py --model llama-3-8b --batch-size 1 --input-len 32 --steps 32 --temperature 1 \
      --rows 30 | tee "$out/profile_b1.txt"
    ;;
  matmuls)  # decode matmul and sampling kernels against cuBLAS / PyTorch (one GPU)
    $py scripts/check_skinny_gemm.py --model llama-3-8b --tp-sizes 1 2 --configs default --rows 1 4 32 \
      --out "$out/skinny.json" 2>&1 | grep -v Warning | tee "$out/skinny.txt"
    $py scripts/check_skinny_gemm.py --model llama-3-70b --tp-sizes 2 --configs default --rows 1 \
      2>&1 | grep -v Warning | tee "$out/skinny70b.txt"
    $py scripts/check_sampling.py 2>&1 | grep -v Warning | tee "$out/sampling.txt"
    ;;
  profile2)  # the same at TP=2 (rank 0's kernels, all-reduces included), batch 1 and 32 (nvidia-h200-x2)
    for b in 1 32; do
      len=$((b == 1 ? 32 : 1000))
      $py -m torch.distributed.run --standalone --nproc-per-node 2 scripts/profile_decode.py --model llama-3-8b \
        -tp 2 --batch-size $b --input-len $len --steps 16 --rows 30 2>&1 | grep -v Warning | tee "$out/profile_tp2_b$b.txt"
    done
    ;;
  messaging)
    for spin in 0 2000; do
      $py -m tp_runtime.cli bench messaging --steps 500 --spin-wait-us $spin --output-json "$out/messaging_spin$spin.json"
    done
    ;;
  serve)  # tp-runtime serve under bench serve at concurrency 1 (the b1 shape) and 32 (the b32 shape), TP 1
           # and 2, each next to bench latency's decode step at batch 1 (nvidia-h200-x2)
    for tp in ${SERVE_TP_SIZES:-1 2}; do
      port=$((8100 + tp))
      $py -m tp_runtime.cli serve --model llama-3-8b --load-format dummy --dtype bfloat16 -tp $tp --port $port \
        --max-num-seqs 64 --max-model-len 2048 --log-level warning --no-access-log > "$out/server_tp$tp.log" 2>&1 &
      server=$!
      wait_healthy $port $server "$out/server_tp$tp.log"
      $py -m tp_runtime.cli bench serve --base-url "http://127.0.0.1:$port" --num-prompts 16 --max-concurrency 1 \
        --input-len 32 --output-len 128 --num-warmups 2 --no-progress --output-json "$out/serve_tp${tp}_c1.json" \
        2>&1 | tee "$out/serve_tp${tp}_c1.txt"
      $py -m tp_runtime.cli bench serve --base-url "http://127.0.0.1:$port" --num-prompts 128 --max-concurrency 32 \
        --input-len 1000 --output-len 128 --num-warmups 2 --no-progress --output-json "$out/serve_tp${tp}_c32.json" \
        2>&1 | tee "$out/serve_tp${tp}_c32.txt"
      kill -TERM $server
      wait $server || true
      bench "latency_tp${tp}_b1" --model llama-3-8b -tp $tp --batch-size 1 --input-len 32 --output-len 128 \
        --num-iters 5 --num-iters-warmup 1
    done
    ;;
  traffic)  # issue 25's serving rows: a fresh server per rate, Poisson arrivals of 600 requests (input 512
            # +-90 %, output 128), sent twice: pass 1 is the fresh server's cold start, pass 2 its steady state.
            # TRAFFIC_RATES (default "24 8"), TRAFFIC_TP (1), TRAFFIC_ARGS (extra serve flags), TRAFFIC_PASSES (2).
    tp=${TRAFFIC_TP:-1}
    port=$((8200 + tp))
    for rate in ${TRAFFIC_RATES:-24 8}; do
      name="traffic_tp${tp}_rate${rate}${TRAFFIC_TAG:-}"
      start=$(date +%s.%N)
      # shellcheck disable=SC2086
      $py -m tp_runtime.cli serve --model llama-3-8b --load-format dummy --dtype bfloat16 -tp "$tp" --port $port \
        --log-level warning --no-access-log ${TRAFFIC_ARGS:-} > "$out/$name.server.log" 2>&1 &
      server=$!
      wait_healthy $port $server "$out/$name.server.log"
      echo "$name: server ready in $($py -c "import time; print(round(time.time() - $start, 1))") s"
      $py -m tp_runtime.cli bench serve --base-url "http://127.0.0.1:$port" --request-rate "$rate" \
        --input-len 512 --range-ratio 0.9 --output-len 128 --num-prompts 600 --vocab-size 120000 \
        --passes "${TRAFFIC_PASSES:-2}" --no-progress --output-json "$out/$name.json" 2>&1 \
        | grep -E "pass|TTFT|TPOT|ITL|throughput|Failed" | tee "$out/$name.txt"
      # The server's own TTFT and its engine-side parts (every pass together).
      $py -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$port/metrics').read().decode())" \
        | grep -E "^tp_runtime:(time_to_first_token|request_queue_time|request_prefill_time)_seconds_(sum|count)" \
        | tee -a "$out/$name.txt" || true
      kill -TERM $server
      wait $server || true
    done
    ;;
  fp8)  # issue 27: the FP8 kernels against float64, then Llama-3-8B b1/b32 with online FP8 next to bf16 and
         # HF static, then Llama-3-70B FP8 on one GPU, FP8 experts, greedy agreement
    $py scripts/gpu_check.py --only-fp8 2>&1 | grep -E "^FAIL|failed|Error" || true
    b1=(--model llama-3-8b --batch-size 1 --input-len 32 --output-len 128 --num-iters 5 --num-iters-warmup 1)
    b32=(--model llama-3-8b --batch-size 32 --input-len 1000 --output-len 128 --num-iters 3 --num-iters-warmup 1)
    bench fp8_b1 "${b1[@]}" --quantization fp8
    bench fp8_b32 "${b32[@]}" --quantization fp8
    bench bf16_b1 "${b1[@]}"
    bench bf16_b32 "${b32[@]}"
    $py scripts/bench_hf_peer.py --model llama-3-8b --batch-size 32 --input-len 1000 --output-len 128 \
      --cache-implementation static --output-json "$out/hf_static_b32.json"
    $py scripts/bench_hf_peer.py --model llama-3-8b --batch-size 1 --input-len 32 --output-len 128 \
      --cache-implementation static --num-iters 5 --output-json "$out/hf_static_b1.json"
    bench fp8_70b_b1 --model llama-3-70b --batch-size 1 --input-len 32 --output-len 128 --num-iters 3 \
      --num-iters-warmup 1 --quantization fp8
    # FP8 experts against bf16 ones, one layer of each shape; greedy agreement with an fp32 reference
    $py scripts/bench_moe.py --output-json "$out/moe.json" | tail -16
    $py scripts/check_fp8_agreement.py --model llama-3-8b --prompts 32 --max-tokens 64 \
      --output-json "$out/fp8_agreement.json" | tail -4
    ;;
  kvfp8)  # kv_cache_dtype fp8: its kernels and engine against references, then Llama-3-8B b1, b32 and a
          # long-context b32 with the FP8 cache next to the bf16 one, HF static as the peer
    $py scripts/gpu_check.py --only-kv-fp8 2>&1 | grep -E "^ok|^FAIL|failed|Error" || true
    b1=(--model llama-3-8b --batch-size 1 --input-len 32 --output-len 128 --num-iters 5 --num-iters-warmup 1)
    b32=(--model llama-3-8b --batch-size 32 --input-len 1000 --output-len 128 --num-iters 3 --num-iters-warmup 1)
    long=(--model llama-3-8b --batch-size 32 --input-len 8000 --output-len 128 --num-iters 2 --num-iters-warmup 1)
    for kv in fp8 auto; do
      bench "kv_${kv}_b32" "${b32[@]}" --kv-cache-dtype $kv
      bench "kv_${kv}_b1" "${b1[@]}" --kv-cache-dtype $kv
      bench "kv_${kv}_b32_in8000" "${long[@]}" --kv-cache-dtype $kv
    done
    $py scripts/bench_hf_peer.py --model llama-3-8b --batch-size 32 --input-len 1000 --output-len 128 \
      --cache-implementation static --output-json "$out/hf_static_b32.json"
    ;;
  prefix)  # issue 26: 64 requests of one shared 2000-token prefix and 64 tokens of their own, 32 out: caching
           # off, on (each pass from an empty cache), and a repeat served from the cache; then multi-turn chat
           # through serve with caching on and off
    for mode in off on repeat; do
      flags=(--enable-prefix-caching)
      [ $mode = off ] && flags=(--no-enable-prefix-caching)
      [ $mode = repeat ] && flags+=(--keep-prefix-cache)
      $py -m tp_runtime.cli bench throughput --model llama-3-8b --load-format dummy --dtype bfloat16 \
        --prefix-len 2000 --input-len 64 --output-len 32 --num-prompts 64 --num-passes 3 "${flags[@]}" \
        --output-json "$out/prefix_$mode.json" 2>&1 | grep -E "pass|requests," | tee "$out/prefix_$mode.txt"
    done
    # (the built-in shapes' tokenizers carry no chat template)
    chat_template='{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>'
    for caching in --enable-prefix-caching --no-enable-prefix-caching; do
      name="multi_turn${caching#--}"
      $py -m tp_runtime.cli serve --model llama-3-8b --load-format dummy --dtype bfloat16 --port 8301 \
        --log-level warning --no-access-log $caching --chat-template "$chat_template" \
        > "$out/$name.server.log" 2>&1 &
      server=$!
      wait_healthy 8301 $server "$out/$name.server.log"
      $py -m tp_runtime.cli bench serve --base-url http://127.0.0.1:8301 --endpoint /v1/chat/completions \
        --multi-turn 6 --num-prompts 16 --request-rate 2 --input-len 300 --output-len 64 --no-progress \
        --output-json "$out/$name.json" 2>&1 | tail -16 | tee "$out/$name.txt" || true
      kill -TERM $server
      wait $server || true
    done
    ;;
  structured)  # issue 28: a batch of 32 under a JSON schema against the same batch unconstrained, then the
               # b32 latency row with HF static as its peer
    $py scripts/bench_structured.py --model llama-3-8b --batch-size 32 --output-len 128 \
      --output-json "$out/structured.json" 2>&1 | grep -E "step|sample|Error"
    bench bf16_b32 --model llama-3-8b --batch-size 32 --input-len 1000 --output-len 128 --num-iters 3 \
      --num-iters-warmup 1
    $py scripts/bench_hf_peer.py --model llama-3-8b --batch-size 32 --input-len 1000 --output-len 128 \
      --cache-implementation static --output-json "$out/hf_static_b32.json"
    ;;
  families)  # fp32: every new family gives the same greedy tokens at TP 1 and 2, and HF's (nvidia-h200-x2)
    $py scripts/check_families.py --device cuda --tp-sizes 1 2 --output-json "$out/families.json"
    ;;
  throughput)  # issue 25's offline row: 256 prompts of 100-1000 tokens, 128 out each (the bar's workload),
              # then the same prompts with 23-232 out; two passes each. HF's continuous batching
              # (generate_batch) on the same prompts, 128 out, as the peer. THROUGHPUT_ARGS: extra engine
              # flags (e.g. --max-num-batched-tokens 4096), THROUGHPUT_TAG names the run.
    for out_ratio in 0 0.818; do
      name="throughput${THROUGHPUT_TAG:-}_out${out_ratio}"
      # shellcheck disable=SC2086
      $py -m tp_runtime.cli bench throughput --model llama-3-8b --load-format dummy --dtype bfloat16 \
        --input-len 550 --range-ratio 0.818 --output-range-ratio $out_ratio --output-len 128 --num-prompts 256 \
        --num-passes 2 ${THROUGHPUT_ARGS:-} --output-json "$out/$name.json" 2>&1 | grep -E "pass|requests," \
        | tee "$out/$name.txt"
    done
    [ -n "${THROUGHPUT_NO_PEER:-}" ] || $py scripts/bench_hf_throughput.py --num-passes 1 \
      --output-json "$out/hf_generate_batch.json" 2>&1 | tail -3
    ;;
  fresh)  # issue 25: a prompt length never seen before against a repeat, and a 145-token prompt's TTFT
          # against its forward's device time; HF transformers' forward in the same process
    $py scripts/bench_fresh_prompts.py --model llama-3-8b --output-json "$out/fresh_prompts.json" 2>&1 | tail -4
    ;;
  peer)
    for cache in static dynamic; do
      $py scripts/bench_hf_peer.py --model llama-3-8b --batch-size 32 --input-len 1000 --output-len 128 \
        --cache-implementation $cache --output-json "$out/hf_${cache}_b32.json"
    done
    $py scripts/bench_hf_peer.py --model llama-3-8b --batch-size 1 --input-len 32 --output-len 128 \
      --cache-implementation static --num-iters 5 --output-json "$out/hf_static_b1.json"
    ;;
  *)
    echo "unknown part $part" >&2
    exit 2
    ;;
esac

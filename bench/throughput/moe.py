"""MoE models: rollout throughput against HF `generate`, expert parallelism's step time, routing replay.

1. Throughput (seeded, GRPO-shaped, like `bench/throughput/hybrid.py`): a random Qwen3-MoE (hidden 256, 4
   layers, 16 experts, top-4, vocab 32000), `--prompts` prompts of 32-128 tokens, `--n` samples
   each, every sample with its own length, temperature 1, EOS ignored. HF `generate` gets its best
   batch size (a sweep over `--hf-batches` on the first prompts picks it).
2. EP=2 vs EP=1: the same requests served by one process, and by two expert-parallel ranks (real
   processes, gloo, each with half the experts and half the requests, one torch thread each);
   median step time, tokens/s, and the ZMQ step agreement's share of the step. The single process
   runs at 1 thread and at 2 (the group's cores).
3. Routing replay in bf16: the engine's routing against an HF trainer's over the generated
   sequences, per token (any sparse layer differing), and the trainer's log-prob mismatch,
   without and with replay.

Usage: `python bench/throughput/moe.py [--quick] [--threads 2] [--parts throughput,ep,replay]`. Exits 1 if an
engine returned other token counts than asked, or EP changed a greedy output.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: before torch loads OpenMP; see common.py

import argparse  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.common import load_average, machine_line, print_result  # noqa: E402
from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams  # noqa: E402

FIRST_TOKEN, VOCAB = 3, 32_000
ROOT = Path(__file__).resolve().parents[2]


def moe_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return Qwen3MoeForCausalLM(cfg).to(dtype).eval()


# ---- 1. throughput ---------------------------------------------------------------------------


def bench_throughput(model, args) -> bool:
    from bench.throughput.hybrid import run_engine, run_hf, workload

    prompts, lengths = workload(args.prompts, args.n, (32, 128), args.output_len, args.seed)
    useful = sum(map(sum, lengths))
    print(f"\n-- throughput: {len(prompts)} prompts x n={args.n}, prompts 32-128 tokens, outputs "
          f"{args.output_len[0]}-{args.output_len[1]} per sample, {useful:,} tokens asked for")
    sweep_n = min(len(prompts), max(args.hf_batches))
    sweep_lengths = [[min(m, 32) for m in ls] for ls in lengths[:sweep_n]]
    sweep = {b: run_hf(model, prompts[:sweep_n], sweep_lengths, b) for b in args.hf_batches}
    best = min(sweep, key=sweep.get)
    print(f"  HF batch-size sweep (prompts per generate call, first {sweep_n} prompts, outputs cut to 32): "
          + ", ".join(f"{b}: {s:.1f} s" for b, s in sweep.items()) + f" -> {best}")
    load = load_average()
    wall, ok, stats = run_engine(model, prompts, lengths)
    hf_wall = run_hf(model, prompts, lengths, best)
    ours, theirs = useful / wall, useful / hf_wall
    print(f"  engine (n={args.n} fork)         {wall:7.1f} s {ours:8.1f} tok/s{'' if ok else '  TOKEN COUNTS WRONG'}"
          f"  (load {load:.2f})")
    print(f"  HF generate ({best} prompts/batch) {hf_wall:7.1f} s {theirs:8.1f} tok/s")
    print(f"  engine / HF generate at its best batch size: {ours / theirs:.2f}x")
    print_result("moe_throughput", {"engine_tok_s": ours, "hf_tok_s": theirs, "ratio": ours / theirs})
    return ok


# ---- 2. EP=2 vs EP=1 -------------------------------------------------------------------------

EP_CONFIG = dict(block_size=16, num_blocks=512, max_requests=32, max_batch_tokens=512, chunked_prefill_size=256,
                 max_sequence_length=256)


def ep_requests(args) -> list[list]:
    import random

    rng = random.Random(args.seed + 2)
    return [[f"r{i}", [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(rng.randint(32, 96))], args.ep_tokens]
            for i in range(args.ep_requests)]


def ep_worker(job_path: str) -> int:
    """One rank (`--ep-worker JOB.json`): serve its requests in lockstep, write timings as JSON."""
    from inference.ep_launch import start_ep_rank

    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(1)
    engine = start_ep_rank(job["model_dir"], InferenceConfig(**EP_CONFIG), rank=job["rank"],
                           world_size=job["world_size"], dist_init=job["dist_init"], ep_address=job["ep_address"],
                           timeout_s=60.0)
    result = run_timed(engine, job["requests"], ep=True)
    Path(job["out"]).write_text(json.dumps(result))
    return 0


def run_timed(engine, requests, *, ep: bool) -> dict:
    """Warm up, then serve `requests` greedily; step times, agreement time, outputs by key."""
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for *_, m in requests]
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    if ep:
        engine.add_request([FIRST_TOKEN] * 16, warm)
        engine.step_until_ep_idle()
    else:
        engine.generate([[FIRST_TOKEN] * 16], warm)
    agree = [0.0]
    if ep:
        comm = engine.core.ep.comm
        sync = comm.sync_all_reduce_max

        def timed_sync(values):
            start = time.perf_counter()
            try:
                return sync(values)
            finally:
                agree[0] += time.perf_counter() - start

        comm.sync_all_reduce_max = timed_sync
    ids = {engine.add_request(p, sp): key for (key, p, _), sp in zip(requests, params)}
    times, outputs = [], []
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        outputs += engine.step()
        times.append(time.perf_counter() - t0)
        if (engine.core.ep.all_idle if ep else not engine.has_unfinished_requests()):
            break
    wall = time.perf_counter() - start
    return {"wall": wall, "median_step": statistics.median(times), "steps": len(times), "agree": agree[0],
            "outputs": {ids[o.request_id]: o.generated_token_ids for o in outputs if o.request_id in ids}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ep_group(tmp: str, requests, index: int) -> list[dict] | None:
    """Two EP ranks in their own processes, half the requests each; their timings (None: failed)."""
    dist_init, address = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs, outs = [], []
    for rank in range(2):
        out, job = Path(tmp) / f"ep{index}_{rank}.json", Path(tmp) / f"job{index}_{rank}.json"
        job.write_text(json.dumps(dict(model_dir=tmp, rank=rank, world_size=2, dist_init=dist_init,
                                       ep_address=address, requests=requests[rank::2], out=str(out))))
        procs.append(subprocess.Popen([sys.executable, __file__, "--ep-worker", str(job)], env=env))
        outs.append(out)
    for proc in procs:
        proc.wait(timeout=1800)
    return None if any(p.returncode for p in procs) else [json.loads(o.read_text()) for o in outs]


def bench_expert_parallel(model, args) -> bool:
    requests = ep_requests(args)
    tokens = sum(m for *_, m in requests)
    print(f"\n-- expert parallelism: {len(requests)} requests of 32-96 prompt tokens, {args.ep_tokens} greedy "
          f"tokens each ({tokens:,}); EP=2: two processes (gloo), half the experts and requests each, 1 thread "
          f"each; {args.repeats} interleaved repeats, medians")
    runs: dict[str, list[dict]] = {"1": [], "2": [], "ep2": []}
    same = True
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        for repeat in range(args.repeats):  # NOTE: interleaved, so a load spike hits every variant alike
            for threads in (1, 2):
                torch.set_num_threads(threads)
                engine = DynamicInferenceEngine.from_pretrained(tmp, InferenceConfig(**EP_CONFIG))
                runs[str(threads)].append(run_timed(engine, requests, ep=False))
            torch.set_num_threads(args.threads)
            ranks = run_ep_group(tmp, requests, repeat)
            if ranks is None:
                print("  an EP rank failed")
                return False
            merged = {k: v for r in ranks for k, v in r["outputs"].items()}
            same &= merged == runs["1"][-1]["outputs"]
            runs["ep2"].append({"wall": max(r["wall"] for r in ranks), "steps": ranks[0]["steps"],
                                "median_step": statistics.median(r["median_step"] for r in ranks),
                                "agree": max(r["agree"] for r in ranks) / max(r["wall"] for r in ranks)})
    med = {k: {f: statistics.median(r[f] for r in v) for f in ("wall", "median_step")} for k, v in runs.items()}
    for name, label in (("1", "EP=1, 1 thread "), ("2", "EP=1, 2 threads"), ("ep2", "EP=2, 1 thread each")):
        m = med[name]
        print(f"  {label}: {m['wall']:6.2f} s {tokens / m['wall']:8.1f} tok/s, median step "
              f"{m['median_step'] * 1e3:6.1f} ms")
    agree = statistics.median(r["agree"] for r in runs["ep2"])
    step_ratio = med["ep2"]["median_step"] / med["2"]["median_step"]
    print(f"  EP=2 / EP=1 step time: {med['ep2']['median_step'] / med['1']['median_step']:.2f}x (1 thread), "
          f"{step_ratio:.2f}x (2 threads: the same cores); throughput EP=2 / EP=1 (2 threads): "
          f"{med['2']['wall'] / med['ep2']['wall']:.2f}x; step agreement {agree:.1%} of EP=2's wall time; "
          f"greedy outputs identical: {same}")
    print_result("moe_expert_parallel", {"ep2_step_ms": med["ep2"]["median_step"] * 1e3,
                                          "ep1_step_ms": med["1"]["median_step"] * 1e3,
                                          "ep1_2t_step_ms": med["2"]["median_step"] * 1e3,
                                          "ep2_over_ep1_2t_step": step_ratio})
    return same


# ---- 3. routing replay -----------------------------------------------------------------------


@torch.no_grad()
def bench_routing_replay(args) -> bool:
    from inference.models.moe.routing_replay import pad_routes, replay_routing, routing_flips

    model = moe_model(args.seed, torch.bfloat16)
    import random

    rng = random.Random(args.seed + 3)
    prompts = [[rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(rng.randint(32, 96))] for _ in range(args.replay)]
    engine = DynamicInferenceEngine.from_pretrained(model, InferenceConfig(**EP_CONFIG, dtype="bfloat16"))
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=1,
                                                   return_routed_experts=True))
    print(f"\n-- routing replay, bf16: {len(outs)} samples of 32-96 prompt + 32 sampled tokens, trainer = HF forward")
    figures = {}
    for replay in (False, True):
        flips, layer_flips, diffs = [], [], []
        for o in outs:
            ids = torch.tensor([o.prompt_token_ids + o.generated_token_ids])
            routes = pad_routes([o.routed_experts], ids.shape[1])
            with replay_routing(model, routes if replay else None) as used:
                logits = model(ids).logits[0].float()
            trainer = torch.stack([u[0] for u in used], dim=1)[: ids.shape[1] - 1]
            differ = routing_flips(routes[0, : ids.shape[1] - 1], trainer)
            flips.append(differ.any(-1).float())
            layer_flips.append(differ.float().flatten())
            p = len(o.prompt_token_ids)
            ref = torch.log_softmax(logits[p - 1 : -1], -1).gather(1, torch.tensor(o.generated_token_ids)[:, None])
            diffs.append((ref[:, 0] - torch.tensor(o.logprobs)).abs())
        f, lf, d = torch.cat(flips).mean().item(), torch.cat(layer_flips).mean().item(), torch.cat(diffs)
        figures[replay] = (f, d.mean().item())
        print(f"  {'with' if replay else 'without'} replay: tokens routed differently {f:6.2%} "
              f"(token-layers {lf:6.2%}); |engine - trainer| log-prob mean {d.mean():.4f}, max {d.max():.3f}")
    print_result("moe_routing_replay", {"flips_without": figures[False][0], "flips_with": figures[True][0],
                                        "mismatch_without": figures[False][1], "mismatch_with": figures[True][1]})
    return figures[True][0] == 0.0


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--output-len", type=_range, default=(16, 128), help="LOW-HIGH per sample")
    parser.add_argument("--hf-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16])
    parser.add_argument("--ep-requests", type=int, default=32)
    parser.add_argument("--ep-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the EP comparison")
    parser.add_argument("--replay", type=int, default=32, help="samples of the routing-replay measurement")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", default="throughput,ep,replay", help="which sections to run (comma-separated)")
    parser.add_argument("--quick", action="store_true", help="smoke run: few prompts, short outputs")
    parser.add_argument("--ep-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ep_worker:
        return ep_worker(args.ep_worker)
    if args.quick:
        args.prompts, args.n, args.output_len, args.hf_batches = 4, 2, (4, 12), [1, 4]
        args.ep_requests, args.ep_tokens, args.replay, args.repeats = 8, 8, 4, 1
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    model = moe_model(args.seed)
    print(f"Qwen3-MoE (random init, hidden 256, 4 layers, 16 experts top-4, vocab {VOCAB}), fp32; {machine_line()}")
    parts, ok = set(args.parts.split(",")), True
    if "throughput" in parts:
        ok &= bench_throughput(model, args)
    if "ep" in parts:
        ok &= bench_expert_parallel(model, args)
    if "replay" in parts:
        ok &= bench_routing_replay(args)
    print(f"done; {machine_line()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

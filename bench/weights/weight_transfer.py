"""Weight sync across processes: GB/s of each transport next to a raw in-process copy, same run.

    python bench/weights/weight_transfer.py                 # 100M (fp32) and 1B (bf16) random parameters
    python bench/weights/weight_transfer.py --quick         # 10M, one repeat: a smoke run
    python bench/weights/weight_transfer.py --delta         # delta syncs against full ones (bf16, gloo and shm)
    python bench/weights/weight_transfer.py --device cuda   # GPU: trainer tensors and replicas on CUDA; shm is CUDA
                                                # IPC, nccl with a replica on cuda:1 when there are 2 GPUs

The trainer is this process; the replicas are real `RolloutServer` processes (random-weight
DenseDecoders of the same spec, behind ZMQ). A sync is timed from `WeightSender.sync()` until it
returns, i.e. until every replica's commit has returned (manifest, checksums both ends, buckets,
staged double loads, commit). Each transport syncs once untimed first (first-touch of every
buffer: the steady state is what an RL loop pays each step), then `--repeats` timed syncs.

* `shm`: buckets in a /dev/shm segment the replicas copy from; `gloo`: torch.distributed
  broadcast over loopback TCP; `disk`: a safetensors directory under --disk-dir;
* `tensor-by-tensor`: one control call and one gloo broadcast per tensor, no buckets, no
  checksum: what several RL frameworks still do, printed for contrast;
* `bare-broadcast`: not a sync but its peer at best: the model's bytes, already flat, through
  gloo's own broadcast collective in 32 MiB pieces, 2 in flight, to R bare processes that do
  nothing else (no manifest, checksum, staging or commit): what a framework's bucketed
  `dist.broadcast` costs before any of its own work;
* `raw copy`: every weight tensor `copy_`'d into one flat buffer of the model's bytes (warm) in
  this process (on the device with `--device cuda`), what a user writes: the baseline every
  transport is measured against. The header also prints the streaming copy+checksum kernel the
  transports use (`weight_sync.memcopy`) on the same bytes, a faster reference (shm can beat a
  `copy_` with one replica: its trainer and replica each stream the bytes once, overlapped).

`--delta` (`bench/weights/delta_sync.py`): a `WeightSender(delta=True)` alternates full syncs
(`sync(full=True)`) and delta syncs of a bf16 model whose weights change, between syncs, at the
density measured on SmolLM2 (fp32 AdamW at lr 1e-6, bf16 cast); it prints bytes on the wire and
seconds of each, and their ratios (full / delta), medians of interleaved pairs.

GB/s is model bytes / seconds until every replica committed; `xraw` is the raw copy's time over
the sync's (1.0 = as fast as one in-process copy of the model). A raw copy runs right before
each timed sync and `xraw` is the median of the pairs' ratios, so a sync and its baseline share
the machine's load. With R replicas a transport moves R x the model's bytes; `deliv` shows that
aggregate (R x model bytes / seconds). Targets (2 replicas, `xraw`): shm >= 0.5, gloo >= 0.25.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

# NOTE: the repository root first, so the replica processes this script starts import this checkout
from bench.common import load_average, machine_line, print_result, random_weights, spec_for  # noqa: E402

DEFAULT_DTYPES = {"10M": "float32", "100M": "float32", "1B": "bfloat16"}
TRANSPORTS = ("shm", "gloo", "bare-broadcast", "disk", "tensor-by-tensor")


# ---- a replica: `python bench/weights/weight_transfer.py --replica --model SIZE --dtype D --host H --port P` ----


def replica_main(argv: list[str]) -> int:
    from inference import DynamicInferenceEngine, InferenceConfig
    from inference.models.dense.decoder import DenseDecoder
    from rollout.server.serve import READY_PREFIX
    from rollout.server.server import RolloutServer, ServerConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    spec = spec_for(args.model, dtype)
    weights = {n: torch.zeros(shape, dtype=dtype, device=args.device) for n, shape in spec.weight_shapes().items()}
    config = InferenceConfig(block_size=16, kv_memory_bytes=8 * 2**20, max_requests=4, max_batch_tokens=64,
                             max_sequence_length=256, dtype=dtype, device=args.device)
    engine = DynamicInferenceEngine(DenseDecoder(spec, weights), config, command_timeout=600)
    server = RolloutServer(engine, ServerConfig(host=args.host, port=args.port, weight_sync_timeout_s=300))
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    print(f"{READY_PREFIX}{server.address} (bench replica {args.model} {args.dtype})", flush=True)
    server.serve_forever()
    return 0


# ---- the trainer ----------------------------------------------------------------------------------


class RawCopy:
    """The peer: every weight tensor copied into one flat buffer of the model's bytes, in this
    process (warm: the buffer is written once before any timing)."""

    def __init__(self, weights: dict[str, torch.Tensor], device: str) -> None:
        self.sources = [t.reshape(-1).view(torch.uint8) for t in weights.values()]
        self.device = device
        self.dst = torch.zeros(sum(s.numel() for s in self.sources), dtype=torch.uint8, device=device)
        self()

    def __call__(self) -> float:
        _synchronize(self.device)
        start = time.perf_counter()
        offset = 0
        for src in self.sources:
            self.dst[offset : offset + src.numel()].copy_(src)
            offset += src.numel()
        _synchronize(self.device)
        return time.perf_counter() - start


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_pairs(run, raw_copy: RawCopy, repeats: int) -> dict[str, float]:
    """`run(0)` once, cold (its seconds: `first`), then `repeats` times a raw copy and `run(i)` back
    to back: their medians, and the median of each pair's ratio (raw / run, `xraw`)."""
    start = time.perf_counter()
    run(0)
    first = time.perf_counter() - start
    raws, runs = [], []
    for i in range(1, 1 + repeats):
        raws.append(raw_copy())
        start = time.perf_counter()
        run(i)
        runs.append(time.perf_counter() - start)
    return dict(first=first, seconds=statistics.median(runs), raw=statistics.median(raws),
                xraw=statistics.median(r / s for r, s in zip(raws, runs)))


BARE_PIECE_BYTES = 32 * 2**20


def bare_broadcast(group, buf: torch.Tensor) -> None:
    """`buf` through gloo's broadcast collective in pieces (`WeightGroup.pipeline`: 2 in flight),
    then one agreement."""
    group.pipeline(buf[lo : lo + BARE_PIECE_BYTES] for lo in range(0, buf.numel(), BARE_PIECE_BYTES))
    group.agree(True)


def _bare_receiver(rank: int, world: int, port: int, nbytes: int, syncs: int) -> None:
    from weight_sync.transports.distributed import WeightGroup

    torch.set_num_threads(1)
    group = WeightGroup.join("127.0.0.1", port, world_size=world, rank=rank, timeout_s=600)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    for _ in range(syncs):
        bare_broadcast(group, buf)
    group.close()


def time_bare_broadcast(raw_copy: RawCopy, replicas: int, repeats: int) -> dict[str, float]:
    """`bare-broadcast` (see module docstring): the model's flat bytes to `replicas` bare processes."""
    import multiprocessing

    from weight_sync.transports.distributed import WeightGroup

    buf = raw_copy.dst.cpu()
    nbytes = buf.numel()
    group = WeightGroup.host("127.0.0.1", 0, world_size=1 + replicas, timeout_s=600)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_bare_receiver, args=(r, 1 + replicas, group.port, nbytes, 1 + repeats), daemon=True)
             for r in range(1, 1 + replicas)]
    for p in procs:
        p.start()
    try:
        group.connect()
        return time_pairs(lambda i: bare_broadcast(group, buf), raw_copy, repeats)
    finally:
        group.close()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def streaming_copy_seconds(weights: dict[str, torch.Tensor], repeats: int) -> float:
    """The transports' copy+checksum kernel over the model's bytes into a warm flat buffer."""
    from weight_sync import memcopy

    sources = [t.reshape(-1).view(torch.uint8).numpy() for t in weights.values()]
    dst = torch.zeros(sum(s.size for s in sources), dtype=torch.uint8).numpy()
    times = []
    for _ in range(repeats + 1):
        start, offset = time.perf_counter(), 0
        for src in sources:
            memcopy.copy_sum(dst[offset : offset + src.size], src)
            offset += src.size
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def bench_size(size: str, dtype_name: str, args) -> list[dict]:
    from rollout import RolloutClient, ServerProcess
    from weight_sync import Transport, WeightSender

    dtype = getattr(torch, dtype_name)
    spec = spec_for(size, dtype)
    print(f"\n{size}: building {dtype_name} weights and {max(args.replicas)} replicas ...", flush=True)
    weights = {n: t.to(args.device) for n, t in random_weights(spec, seed=0).items()}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    params = sum(t.numel() for t in weights.values())
    entry = (str(Path(__file__).resolve()), "--replica")
    devices = replica_devices(args.device, max(args.replicas))
    procs = [ServerProcess(size, "--dtype", dtype_name, "--device", d, entry=entry, ready_timeout=600)
             for d in devices]
    rows = []
    version = 1
    try:
        clients = [RolloutClient(p.address, timeout=900) for p in procs]
        raw_copy = RawCopy(weights, args.device)
        stream = streaming_copy_seconds(weights, args.repeats) if args.device == "cpu" else float("nan")
        print(f"{size}: {params / 1e6:.0f}M parameters, {nbytes / 2**30:.2f} GiB; trainer on {args.device}, replicas "
              f"on {', '.join(devices)}; {machine_line()}", flush=True)
        torch_copy = statistics.median(raw_copy() for _ in range(args.repeats))
        print(f"{size}: in-process copies of the model's bytes: torch copy_ {torch_copy * 1e3:.0f} ms (the raw-copy "
              f"baseline), streaming copy+checksum kernel {stream * 1e3:.0f} ms", flush=True)
        for replicas in args.replicas:
            for transport in args.transports:
                if transport == "tensor-by-tensor" and size == "1B" and not args.slow_contrast:
                    continue
                if transport == "bare-broadcast":
                    if args.device != "cpu":
                        continue
                    load = load_average()
                    timed = time_bare_broadcast(raw_copy, replicas, args.repeats)
                    rows.append(report(size, replicas, transport, timed, nbytes, dtype_name, load))
                    continue
                if transport == "nccl" and args.device in devices[:replicas]:
                    print(f"{size:>5} R={replicas} {transport:>16}: skipped (NCCL needs the replicas on other GPUs "
                          "than the trainer's)", flush=True)
                    continue
                kwargs = dict(bucket_bytes=args.bucket_mib * 2**20, timeout_s=600)
                if transport == "disk":  # NOTE: one version directory on disk at a time
                    kwargs.update(directory=tempfile.mkdtemp(dir=args.disk_dir, prefix="bench-wsync-"), keep_last=1)
                over = Transport.GLOO if transport == "tensor-by-tensor" else Transport(transport)
                try:
                    with WeightSender(clients[:replicas], over, tensor_by_tensor=transport == "tensor-by-tensor",
                                      **kwargs) as sender:
                        load = load_average()
                        timed = time_pairs(lambda i, v=version: sender.sync(weights, version=v + i), raw_copy,
                                           args.repeats)
                        version += 1 + args.repeats
                finally:
                    if "directory" in kwargs:
                        shutil.rmtree(kwargs["directory"], ignore_errors=True)
                rows.append(report(size, replicas, transport, timed, nbytes, dtype_name, load))
        for c in clients:
            c.close()
    finally:
        for p in procs:
            p.stop()
    return rows


def report(size: str, replicas: int, transport: str, timed: dict, nbytes: int, dtype_name: str, load: float) -> dict:
    seconds, raw = timed["seconds"], timed["raw"]
    row = dict(size=size, replicas=replicas, transport=transport, **timed, gbps=nbytes / seconds / 1e9,
               deliv=replicas * nbytes / seconds / 1e9, load=load)
    key = f"[{size},R{replicas},{transport}]"  # NOTE: compare_commits merges every RESULT line's figures
    print_result("weight_sync", {f"gbps{key}": row["gbps"], f"xraw{key}": row["xraw"]},
                 dtype=dtype_name, raw_copy_s=raw, load=load)
    print(f"{size:>5} R={replicas} {transport:>16} {seconds * 1e3:>9.0f} ms  {row['gbps']:>6.2f} GB/s  "
          f"xraw {row['xraw']:>5.2f} (raw copy {raw * 1e3:.0f} ms)  deliv {row['deliv']:>6.2f} GB/s  "
          f"(first sync {timed['first'] * 1e3:.0f} ms, load {load:.1f})", flush=True)
    return row


def replica_devices(device: str, count: int) -> list[str]:
    """Where the replicas run: the trainer's device on CPU or with one GPU; else the other GPUs."""
    if not device.startswith("cuda") or torch.cuda.device_count() < 2:
        return [device] * count
    others = [f"cuda:{i}" for i in range(torch.cuda.device_count()) if torch.device(f"cuda:{i}") != torch.device(
        device if ":" in device else "cuda:0")]
    return [others[i % len(others)] for i in range(count)]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--replica":
        return replica_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100M,1B")
    parser.add_argument("--replicas", default="1,2", help="replica counts to measure (comma-separated)")
    parser.add_argument("--transports", help=f"comma-separated (default {','.join(TRANSPORTS)}; cuda: nccl too)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the trainer's tensors and the replicas")
    parser.add_argument("--repeats", type=int, default=5, help="timed (raw copy, sync) pairs per row")
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--disk-dir", default=None, help="where the disk transport writes (default: a temp dir)")
    parser.add_argument("--slow-contrast", action="store_true", help="also run tensor-by-tensor at 1B")
    parser.add_argument("--quick", action="store_true", help="10M, one repeat, 2 replicas")
    parser.add_argument("--delta", action="store_true", help="delta syncs against full ones (delta_sync.py)")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.repeats, args.replicas = "10M", 1, "2"
    args.replicas = [int(r) for r in args.replicas.split(",")]
    if args.delta:
        from bench.weights.delta_sync import run_delta_bench

        return run_delta_bench(args)
    if args.transports is None:
        args.transports = ",".join(TRANSPORTS[:2] + ("nccl",) + TRANSPORTS[2:]) if args.device != "cpu" else \
            ",".join(TRANSPORTS)
    args.transports = args.transports.split(",")
    torch.set_num_threads(1)
    rows = []
    for size in args.sizes.split(","):
        rows += bench_size(size, DEFAULT_DTYPES.get(size, "bfloat16"), args)
    print("\nsummary (xraw: raw copy time / sync time; targets with 2 replicas: shm >= 0.5, gloo >= 0.25)")
    for row in rows:
        print(f"  {row['size']:>5} R={row['replicas']} {row['transport']:>16}: {row['gbps']:.2f} GB/s, "
              f"xraw {row['xraw']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

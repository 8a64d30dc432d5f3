"""Weight-update and suspend/resume cost, each against its raw-torch peer in the same run.

* alias: `on_weights_updated()` after the trainer changed aliased tensors in place; moves no
  bytes, so its time should not grow with the model (10M -> 1B parameters).
* copy: `update_weights(named_tensors)` (validate, copy, commit, reset the prefix cache) against
  a raw `dst.copy_(src)` over the same tensors; target ratio raw/ours >= 0.7.
* suspend/resume: freeing and re-allocating the KV buffer (then writing every page, as a
  rollout would) against a plain `torch.empty(...).fill_(0)` of the same bytes; target
  ours/plain <= 1.5.

Models are random DenseDecoders built from a ModelSpec (no HF module: a 1B HF init alone would
take minutes on 2 cores); bf16 keeps the 1B case within this machine's memory.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import llama_spec
from inference import DynamicInferenceEngine, InferenceConfig
from inference.models.dense.decoder import DenseDecoder
from inference.models.spec import ModelSpec

SIZES = {  # name -> (hidden, layers, intermediate, vocab)
    "10M": (256, 8, 1024, 8192),
    "100M": (768, 12, 2048, 32000),
    "1B": (2048, 16, 5632, 32000),
}


def spec_for(name: str, dtype: torch.dtype) -> ModelSpec:
    return llama_spec(*SIZES[name], dtype)


def random_tensors(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(shape, generator=gen, dtype=torch.float32) * 0.02).to(spec.dtype)
            for n, shape in spec.weight_shapes().items()}


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_size(name: str, dtype: torch.dtype, repeats: int, kv_bytes: int) -> dict:
    spec = spec_for(name, dtype)
    trainer = random_tensors(spec, seed=0)
    params = sum(t.numel() for t in trainer.values())
    config = InferenceConfig(block_size=16, kv_memory_bytes=kv_bytes, max_requests=8, max_batch_tokens=64,
                           max_sequence_length=256, dtype=dtype)

    aliased = DynamicInferenceEngine(DenseDecoder(spec, trainer), config)  # holds the trainer's tensors
    alias_s = median_time(aliased.on_weights_updated, repeats)
    del aliased

    engine = DynamicInferenceEngine(DenseDecoder(spec, random_tensors(spec, seed=1)), config)
    update = random_tensors(spec, seed=2)
    copy_s = median_time(lambda: engine.update_weights(update), repeats)
    targets = list(engine.model.named_tensors().items())
    raw_s = median_time(lambda: [dst.copy_(update[n]) for n, dst in targets], repeats)

    # NOTE: both sides touch every page of the buffer: a lazily mapped buffer that is never
    # written would look free, and a real rollout writes it.
    def cycle():
        engine.suspend()
        engine.resume()
        engine.kv_cache.data.fill_(0)

    cycle_s = median_time(cycle, repeats)
    shape = engine.kv_cache.shape

    def plain():
        buf = torch.empty(shape, dtype=dtype)
        buf.fill_(0)
        del buf

    plain_s = median_time(plain, repeats)
    return dict(name=name, params=params, bytes=sum(t.numel() * t.element_size() for t in update.values()),
                alias_ms=alias_s * 1e3, copy_ms=copy_s * 1e3, raw_ms=raw_s * 1e3, cycle_ms=cycle_s * 1e3,
                plain_ms=plain_s * 1e3, kv_bytes=engine.kv_cache.nbytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10M,100M,1B")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kv-mib", type=int, default=512, help="KV buffer size for suspend/resume")
    parser.add_argument("--quick", action="store_true", help="10M only, 3 repeats, 64 MiB KV")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.repeats, args.kv_mib = "10M", 3, 64
    dtype = getattr(torch, args.dtype)
    print(f"weight update and suspend/resume, {args.dtype}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}")
    header = (f"{'model':>6} {'params':>8} {'alias ms':>9} {'copy ms':>9} {'raw ms':>8} {'raw/copy':>9} "
              f"{'GB/s':>6} {'KV MiB':>7} {'susp+res ms':>11} {'plain ms':>9} {'ours/plain':>10}")
    print(header)
    print("-" * len(header))
    rows = []
    for name in args.sizes.split(","):
        r = bench_size(name, dtype, args.repeats, args.kv_mib * 2**20)
        rows.append(r)
        print(f"{r['name']:>6} {r['params'] / 1e6:>7.0f}M {r['alias_ms']:>9.3f} {r['copy_ms']:>9.1f} "
              f"{r['raw_ms']:>8.1f} {r['raw_ms'] / r['copy_ms']:>9.2f} {r['bytes'] / r['copy_ms'] / 1e6:>6.2f} "
              f"{r['kv_bytes'] / 2**20:>7.0f} {r['cycle_ms']:>11.1f} {r['plain_ms']:>9.1f} "
              f"{r['cycle_ms'] / r['plain_ms']:>10.2f}")
    alias = [r["alias_ms"] for r in rows]
    print(f"alias update: {min(alias):.3f}-{max(alias):.3f} ms across sizes (constant: moves no bytes)")
    print(f"copy update vs raw copy (target >= 0.7): min {min(r['raw_ms'] / r['copy_ms'] for r in rows):.2f}")
    worst = max(r["cycle_ms"] / r["plain_ms"] for r in rows)
    print(f"suspend+resume vs plain allocation (target <= 1.5): max {worst:.2f}")


if __name__ == "__main__":
    main()

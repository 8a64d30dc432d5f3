"""Prefix-cache throughput: match, register, release and LRU eviction at growing pool sizes.

For each pool size the pool is filled with cached chains (4-8 blocks of random tokens each,
zero references), then every repeat runs cycles of: `match_prefix` on fully cached chains
(released again), `allocate(k)` on the full pool (each call evicts k LRU leaves) and `register`
+ `release` of the evicted-into blocks as new chains, so the pool ends each cycle full and
cached again. Each repeat times the same number of operations at every size, repeats of all
sizes interleave, and the median of the repeats is printed.

Two peers evict from a snapshot of the state the timed eviction started from:

* the competent one, an OrderedDict LRU queue (vLLM's free-block queue, in Python): every
  zero-ref cached block in eviction order, each chain's blocks tail first, built untimed from
  the snapshot; a victim is one `popitem(last=False)`. It evicts as many victims as ours did;
  each must be an evictable leaf when taken and the victims' timestamps must match ours one for
  one (ties on timestamp may break differently).
* the naive one, what an allocator without an eviction index does: per victim, one oldest-first
  full scan over the timestamp array (numpy argmin over zero-ref registered leaves), bounded in
  victims; it must pick exactly our victims (ties go to the lower block id in both).

Both peers only choose victims, so they are compared with the time ours spends choosing them
(`find_lru_evictable`, timed inside the timed `allocate` calls): ratios peer/ours, > 1 when
ours is faster. The headline is the growth of our whole per-victim eviction cost (choosing,
deregistering, handing out), printed beside the growth of the choosing alone.

Usage: `python bench/throughput/prefix_cache.py [--sizes 1e3,1e4,1e5,1e6] [--repeats 7] [--quick]`.
Exits 1 if a peer's victims disagree with ours: the < 2x growth target is reported, not
enforced, since timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from bench.throughput.eviction_peers import lru_evict, lru_queue, lru_victims_valid, naive_evict, snapshot_state
from inference.kv_cache import EvictionPolicy, KVBlockAllocator, block_hashes

BLOCK_SIZE = 16
MIN_CHAIN, MAX_CHAIN = 4, 8  # blocks per request, inclusive
VOCAB = 32_000
FILL_BATCH = 8192  # blocks allocated, registered and released per fill step
GROWTH_TARGET = 2.0


@dataclass(frozen=True, slots=True)
class Workload:
    """Operations timed per repeat, the same at every pool size."""

    matches: int = 2048
    victims: int = 4096
    naive_scan_elems: int = 40_000_000  # bounds the naive peer's work: victims * pool size
    naive_min_victims: int = 16


@dataclass(slots=True)
class SizeResult:
    num_blocks: int
    fill_s: float
    match_ops: float  # match_prefix calls/s (full hits)
    register_ops: float  # register calls/s (one 4-8 block chain each)
    release_ops: float  # release calls/s (one chain each)
    evict_ops: float  # allocate(k) calls/s on a full pool, k = 4-8 victims each
    victim_us: float  # ours, per evicted block: the whole allocate(k) call
    select_us: float  # ours, per evicted block: choosing it (find_lru_evictable) only
    lru_victim_us: float  # OrderedDict LRU queue, per evicted block
    naive_victim_us: float  # naive full scan, per evicted block
    naive_victims: int
    victims_agree: bool  # both peers' checks held in every repeat

    @property
    def lru_ratio(self) -> float:
        return self.lru_victim_us / self.select_us

    @property
    def ratio(self) -> float:
        return self.naive_victim_us / self.select_us


class ChainSource:
    """Random-token request chains: each a list of `block_hashes`, 4-8 full blocks long."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def lengths(self, total_blocks: int) -> list[int]:
        """Chain lengths summing to exactly `total_blocks` (the last one may be shorter)."""
        lens = self.rng.integers(MIN_CHAIN, MAX_CHAIN + 1, size=total_blocks // MIN_CHAIN + 1)
        cut = int(np.searchsorted(np.cumsum(lens), total_blocks))
        out = lens[: cut + 1].tolist()
        out[-1] -= sum(out) - total_blocks
        return [n for n in out if n > 0]

    def hashes(self, lengths: list[int]) -> list[list[int]]:
        tokens = self.rng.integers(0, VOCAB, size=sum(lengths) * BLOCK_SIZE)
        chains, start = [], 0
        for n in lengths:
            end = start + n * BLOCK_SIZE
            chains.append(block_hashes(tokens[start:end].tolist(), BLOCK_SIZE))
            start = end
        return chains


def fill(alloc: KVBlockAllocator, source: ChainSource) -> list[list[int]]:
    """Fill the whole pool with registered, released (cached) chains; return their hashes."""
    chains: list[list[int]] = []
    remaining = alloc.free
    while remaining:
        batch = min(FILL_BATCH, remaining)
        lens = source.lengths(batch)
        hashes = source.hashes(lens)
        ids = alloc.allocate(batch)
        start = 0
        for chain in hashes:
            end = start + len(chain)
            alloc.register(ids[start:end], chain, parent_block_id=-1)
            start = end
        alloc.release(ids)
        chains.extend(hashes)
        remaining -= batch
    return chains


class Cycle:
    """One size's steady-state loop; accumulates nanoseconds and op counts per repeat."""

    def __init__(self, alloc: KVBlockAllocator, chains: list[list[int]], source: ChainSource) -> None:
        self.alloc, self.chains, self.source = alloc, chains, source
        self.rng = source.rng
        self.ns = dict.fromkeys(("match", "register", "release", "evict", "select"), 0)
        self._time_selection()
        self.ops = dict.fromkeys(("match", "register", "release", "evict", "victims"), 0)

    def match(self, count: int) -> None:
        """Match `count` fully cached chains, then release them (release timed separately)."""
        table = self.alloc.registry.kv_hash_to_block_id
        self._prune(table)
        picks = self.rng.integers(0, len(self.chains), size=count).tolist()
        queries = [self.chains[i] for i in picks]
        queries = [q for q in queries if q[-1] in table]  # chained hashes: last cached => all cached
        alloc, held = self.alloc, []
        t0 = time.perf_counter_ns()
        for q in queries:
            held.append(alloc.match_prefix(q))
        t1 = time.perf_counter_ns()
        for ids in held:
            alloc.release(ids)
        t2 = time.perf_counter_ns()
        assert all(len(ids) == len(q) for ids, q in zip(held, queries)), "cached chain did not fully match"
        self._add("match", t1 - t0, len(queries))
        self._add("release", t2 - t1, len(held))

    def evict_and_register(self, victims: int, snapshot: bool = False) -> tuple[list[int], dict[str, np.ndarray]]:
        """Evict `victims` LRU leaves via allocate(k) on the full pool, then register them anew.

        Returns our victims in eviction order and, if `snapshot`, the state they were chosen from.
        """
        alloc = self.alloc
        assert alloc.free == 0 and alloc.cached == alloc.total, "pool must be full and cached"
        lens = self.source.lengths(victims)
        new_chains = self.source.hashes(lens)
        snap = snapshot_state(alloc) if snapshot else {}
        held = []
        t0 = time.perf_counter_ns()
        for k in lens:
            held.append(alloc.allocate(k))
        t1 = time.perf_counter_ns()
        for ids, chain in zip(held, new_chains):
            alloc.register(ids, chain, parent_block_id=-1)
        t2 = time.perf_counter_ns()
        for ids in held:
            alloc.release(ids)
        t3 = time.perf_counter_ns()
        self._add("evict", t1 - t0, len(lens))
        self.ops["victims"] += victims
        self._add("register", t2 - t1, len(lens))
        self._add("release", t3 - t2, len(lens))
        self.chains.extend(new_chains)
        # NOTE: with an empty free pool, allocate(k) hands out exactly its k victims, reversed.
        ours = [b for ids in held for b in reversed(ids)]
        return ours, snap

    def _time_selection(self) -> None:
        """Wrap this pool's `find_lru_evictable` so that `ns["select"]` sums its time.

        NOTE: an instance attribute shadows the method for `try_lru_evict_for_pool`'s call; the
        wrapper's own cost (~0.1 us per allocate call, 4-8 victims) is counted as ours.
        """
        state = self.alloc.state
        find = type(state).find_lru_evictable.__get__(state)
        ns = self.ns

        def timed(num_blocks_needed: int):
            start = time.perf_counter_ns()
            try:
                return find(num_blocks_needed)
            finally:
                ns["select"] += time.perf_counter_ns() - start

        state.find_lru_evictable = timed

    def _add(self, key: str, ns: int, ops: int) -> None:
        self.ns[key] += ns
        self.ops[key] += ops

    def _prune(self, table: dict[int, int]) -> None:
        """Forget chains whose root was evicted (untimed bookkeeping of the benchmark)."""
        if len(self.chains) > 2 * self.alloc.total // MIN_CHAIN:
            self.chains = [c for c in self.chains if c[0] in table]


class SizeBench:
    """One pool size: filled once, then timed one repeat at a time (repeats interleave sizes)."""

    def __init__(self, num_blocks: int, work: Workload, seed: int) -> None:
        self.num_blocks = num_blocks
        source = ChainSource(np.random.default_rng(seed))
        self.alloc = KVBlockAllocator(num_blocks, BLOCK_SIZE, EvictionPolicy.LRU)
        t0 = time.perf_counter()
        chains = fill(self.alloc, source)
        self.fill_s = time.perf_counter() - t0
        self.victims_per_cycle = max(MAX_CHAIN, min(work.victims, num_blocks // 4))
        self.cycles = max(1, work.victims // self.victims_per_cycle)
        self.matches_per_cycle = max(1, work.matches // self.cycles)
        naive = max(work.naive_min_victims, work.naive_scan_elems // num_blocks)
        self.naive_victims = min(naive, self.victims_per_cycle)
        self.samples: dict[str, list[float]] = {
            k: [] for k in ("match", "register", "release", "evict", "victim", "select", "naive", "lru")
        }
        self.victims_agree = True
        self.cycle = Cycle(self.alloc, chains, source)
        self.cycle.match(self.matches_per_cycle)  # warm-up: one untimed cycle
        self.cycle.evict_and_register(self.victims_per_cycle)

    def repeat(self) -> None:
        cycle = self.cycle = Cycle(self.alloc, self.cycle.chains, self.cycle.source)
        for i in range(self.cycles):
            cycle.match(self.matches_per_cycle)
            ours, snap = cycle.evict_and_register(self.victims_per_cycle, snapshot=i == 0)
            if i == 0:
                queue = lru_queue(snap)
                t = time.perf_counter_ns()
                lru = lru_evict(queue, len(ours))
                self.samples["lru"].append((time.perf_counter_ns() - t) / 1e3 / max(1, len(lru)))
                self.victims_agree &= lru_victims_valid(snap, lru, ours)
                t = time.perf_counter_ns()
                theirs = naive_evict(snap, self.naive_victims)
                self.samples["naive"].append((time.perf_counter_ns() - t) / 1e3 / max(1, len(theirs)))
                self.victims_agree &= len(theirs) == self.naive_victims and theirs == ours[: len(theirs)]
        for key in ("match", "register", "release", "evict"):
            self.samples[key].append(cycle.ops[key] / (cycle.ns[key] / 1e9))
        self.samples["victim"].append(cycle.ns["evict"] / 1e3 / cycle.ops["victims"])
        self.samples["select"].append(cycle.ns["select"] / 1e3 / cycle.ops["victims"])

    def result(self) -> SizeResult:
        med = {k: statistics.median(v) for k, v in self.samples.items()}
        return SizeResult(
            self.num_blocks, self.fill_s, med["match"], med["register"], med["release"], med["evict"],
            med["victim"], med["select"], med["lru"], med["naive"], self.naive_victims, self.victims_agree,
        )  # fmt: skip


def run(sizes: list[int], repeats: int, work: Workload, seed: int) -> list[SizeResult]:
    """Fill every pool, then time repeat r of every size before repeat r + 1 of any.

    NOTE: interleaving makes background load on a shared machine hit all sizes alike, so the
    growth factor compares like with like.
    """
    benches = [SizeBench(n, work, seed) for n in sizes]
    gc.collect()
    gc.disable()  # NOTE: a collection landing inside one timed loop would dominate small sizes.
    try:
        for _ in range(repeats):
            for bench in benches:
                bench.repeat()
    finally:
        gc.enable()
    return [bench.result() for bench in benches]


def _parse_sizes(text: str) -> list[int]:
    sizes = [int(float(s)) for s in text.split(",") if s.strip()]
    if not sizes or min(sizes) < 4 * MAX_CHAIN:
        raise argparse.ArgumentTypeError(f"sizes must be >= {4 * MAX_CHAIN} blocks, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=_parse_sizes, default=None, help="pool sizes, e.g. 1e3,1e4,1e5,1e6")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per size (median is reported)")
    parser.add_argument("--quick", action="store_true", help="CI smoke: sizes 1e3,1e4 and 3 repeats")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes = args.sizes or ([1_000, 10_000] if args.quick else [1_000, 10_000, 100_000, 1_000_000])
    repeats = args.repeats or (3 if args.quick else 7)
    work = Workload(matches=512, victims=1024, naive_scan_elems=2_000_000) if args.quick else Workload()
    if repeats < 1:
        parser.error("--repeats must be >= 1")

    print(
        f"prefix cache, LRU, block_size={BLOCK_SIZE}, chains of {MIN_CHAIN}-{MAX_CHAIN} blocks, "
        f"median of {repeats} repeats; per repeat {work.matches} matches, {work.victims} victims"
    )
    header = (
        f"{'blocks':>9} {'fill s':>7} {'match/s':>10} {'register/s':>11} {'release/s':>10} {'evict/s':>9} "
        f"{'us/victim':>10} {'choose us/v':>11} {'LRU us/v':>9} {'LRU/ours':>9} {'naive us/v':>11} "
        f"{'naive/ours':>11} {'agree':>12}"
    )
    print(header)
    print("-" * len(header))
    results: list[SizeResult] = []
    for r in run(sizes, repeats, work, args.seed):
        print(
            f"{r.num_blocks:>9,} {r.fill_s:>7.2f} {r.match_ops:>10,.0f} {r.register_ops:>11,.0f} "
            f"{r.release_ops:>10,.0f} {r.evict_ops:>9,.0f} {r.victim_us:>10.2f} {r.select_us:>11.2f} "
            f"{r.lru_victim_us:>9.2f} "
            f"{r.lru_ratio:>8.2f}x {r.naive_victim_us:>11.1f} {r.ratio:>10,.1f}x "
            f"{'yes' if r.victims_agree else 'NO':>6} ({r.naive_victims})"
        )
        results.append(r)
    first, last = results[0], results[-1]
    growth = last.victim_us / first.victim_us
    select_growth = last.select_us / first.select_us
    lru_growth = last.lru_victim_us / first.lru_victim_us
    met = growth < GROWTH_TARGET
    print(
        f"per-victim eviction cost growth {first.num_blocks:,} -> {last.num_blocks:,} blocks: {growth:.2f}x "
        f"(target < {GROWTH_TARGET:g}x: {'met' if met else 'NOT met'}); choosing alone: ours {select_growth:.2f}x, "
        f"OrderedDict LRU {lru_growth:.2f}x"
    )
    print(
        f"choosing a victim at {last.num_blocks:,} blocks, peer / ours: OrderedDict LRU {last.lru_ratio:.2f}x, "
        f"naive scan {last.ratio:,.1f}x (> 1: ours is faster)"
    )
    figures = {"growth": growth, "select_growth": select_growth, "lru_growth": lru_growth}
    for r in results:
        figures[f"victim_us[{r.num_blocks}]"] = r.victim_us
        figures[f"lru/ours[{r.num_blocks}]"] = r.lru_ratio
    print("RESULT " + json.dumps({"bench": "prefix_cache", "figures": figures}, sort_keys=True))
    if not all(r.victims_agree for r in results):
        print("ERROR: a peer's victims disagree with ours (agree: NO above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Hybrid Mamba models: rollout throughput against HF `generate`, and the prefill Mamba prefix caching saves.

1. Throughput (seeded, GRPO-shaped): `--prompts` prompts of 32-128 random tokens, `--n` samples each,
   every sample with its own output length (16-128), temperature 1.0, EOS ignored. tokens/s = the
   tokens asked for / wall time.
   * engine: one request per prompt with n samples (the prompt is prefilled once and forked),
     `max_tokens` = the group's longest sample (the extra tokens are not counted);
   * HF generate: left-padded batches of prompts, `num_return_sequences=n`, `max_new_tokens` = the
     batch's longest; prompts sorted by their longest sample. HF gets its best batch size: a sweep
     over `--hf-batches` on the first prompts picks it, then the full workload runs with it.
2. Prefix caching (seeded): `--systems` shared prefixes of 96 tokens, each followed by requests with
   their own 8-32-token suffix, sent in waves; prefill tokens computed and wall time with prefix
   caching (KV + Mamba state snapshots) on and off; the outputs must be identical (greedy).

Usage: `python bench/throughput/hybrid.py [--family bamba|nemotron_h|falcon_h1] [--quick] [--threads 2]`.
Exits 1 if an engine returned other token counts than asked, or caching changed an output.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: before torch loads OpenMP; see common.py

import argparse  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from transformers.utils import logging as transformers_logging  # noqa: E402

from bench.common import load_average, machine_line  # noqa: E402
from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams  # noqa: E402

FIRST_TOKEN = 3
VOCAB = 32_000


def hybrid_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A random hybrid of `family`: hidden 256, 3 Mamba2 layers and 1 attention layer, vocab 32000."""
    from transformers import (
        BambaConfig,
        BambaForCausalLM,
        FalconH1Config,
        FalconH1ForCausalLM,
        NemotronHConfig,
        NemotronHForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "bamba":
        cfg = BambaConfig(**common, num_hidden_layers=4, attn_layer_indices=[2], mamba_n_heads=8, mamba_d_state=64,
                          mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=64)
        return BambaForCausalLM(cfg).eval()
    if family == "nemotron_h":
        cfg = NemotronHConfig(**common, layers_block_type=["linear_attention", "mlp", "linear_attention",
                                                           "full_attention", "mlp", "linear_attention", "mlp"],
                              head_dim=64, mamba_num_heads=8, mamba_head_dim=64, ssm_state_size=64, n_groups=1,
                              chunk_size=64)
        return NemotronHForCausalLM(cfg).eval()
    cfg = FalconH1Config(**common, num_hidden_layers=2, mamba_d_ssm=512, mamba_n_heads=8, mamba_d_state=64,
                         mamba_n_groups=1, mamba_chunk_size=64, mamba_rms_norm=True)
    return FalconH1ForCausalLM(cfg).eval()


# ---- 1. throughput ---------------------------------------------------------------------------


def workload(prompts: int, n: int, prompt_len: tuple[int, int], out_len: tuple[int, int], seed: int):
    rng = random.Random(seed)
    ps = [[rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(rng.randint(*prompt_len))] for _ in range(prompts)]
    return ps, [[rng.randint(*out_len) for _ in range(n)] for _ in range(prompts)]


def run_engine(model, prompts, lengths) -> tuple[float, bool, dict]:
    longest = max(len(p) + max(ls) for p, ls in zip(prompts, lengths))
    n = len(lengths[0])
    config = InferenceConfig(block_size=16, num_blocks=len(prompts) * n * (-(-longest // 16)) + 64,
                             max_requests=max(len(prompts) * n, 8), max_batch_tokens=max(2048, len(prompts) * n),
                             max_sequence_length=longest)
    engine = DynamicInferenceEngine.from_pretrained(model, config, share_weights=True)
    engine.generate([[FIRST_TOKEN] * 20], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    params = [SamplingParams(n=n, temperature=1.0, max_tokens=max(ls), ignore_eos=True) for ls in lengths]
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    ok = [len(o.generated_token_ids) for o in outs] == [p.max_tokens for p in params for _ in range(n)]
    return wall, ok, engine.stats()


@torch.no_grad()
def run_hf(model, prompts, lengths, per_batch: int) -> float:
    n = len(lengths[0])
    order = sorted(range(len(prompts)), key=lambda g: max(lengths[g]), reverse=True)
    start = time.perf_counter()
    for i in range(0, len(order), per_batch):
        groups = order[i : i + per_batch]
        width = max(len(prompts[g]) for g in groups)
        ids = torch.zeros(len(groups), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, g in enumerate(groups):
            ids[row, width - len(prompts[g]) :] = torch.tensor(prompts[g])
            mask[row, width - len(prompts[g]) :] = 1
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(max(lengths[g]) for g in groups),
                       num_return_sequences=n, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                       eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - start


def bench_throughput(model, args) -> bool:
    prompts, lengths = workload(args.prompts, args.n, (32, 128), args.output_len, args.seed)
    useful = sum(map(sum, lengths))
    print(f"\n-- throughput: {len(prompts)} prompts x n={args.n}, prompts 32-128 tokens, outputs "
          f"{args.output_len[0]}-{args.output_len[1]} per sample, {useful:,} tokens asked for")
    sweep_n = min(len(prompts), max(args.hf_batches))
    sweep_prompts, sweep_lengths = prompts[:sweep_n], [[min(m, 32) for m in ls] for ls in lengths[:sweep_n]]
    sweep = {b: run_hf(model, sweep_prompts, sweep_lengths, b) for b in args.hf_batches}
    best = min(sweep, key=sweep.get)
    print("  HF batch-size sweep (prompts per generate call, on the first "
          f"{sweep_n} prompts, outputs cut to 32): " + ", ".join(f"{b}: {s:.1f} s" for b, s in sweep.items())
          + f" -> {best}")
    load = load_average()
    wall, ok, stats = run_engine(model, prompts, lengths)
    hf_wall = run_hf(model, prompts, lengths, best)
    ours, theirs = useful / wall, useful / hf_wall
    print(f"  engine (n={args.n} fork)      {wall:7.1f} s {ours:8.1f} tok/s  prefilled {stats['prefill_tokens']:,} "
          f"prompt tokens{'' if ok else '  TOKEN COUNTS WRONG'}  (load {load:.2f})")
    print(f"  HF generate ({best} prompts/batch) {hf_wall:7.1f} s {theirs:8.1f} tok/s")
    print(f"  engine / HF generate at its best batch size: {ours / theirs:.2f}x")
    return ok


# ---- 2. prefix caching -----------------------------------------------------------------------


def bench_prefix_cache(model, args) -> bool:
    rng = random.Random(args.seed + 1)
    systems = [[rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(96)] for _ in range(args.systems)]
    waves = [[s + [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(rng.randint(8, 32))] for s in systems]
             for _ in range(args.waves)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    total = sum(len(p) for wave in waves for p in wave)
    print(f"\n-- prefix caching: {args.systems} shared 96-token prefixes x {args.waves} waves, suffixes 8-32 tokens "
          f"({total:,} prompt tokens), greedy, 8 tokens each")
    results = {}
    for on in (False, True):
        config = InferenceConfig(block_size=16, num_blocks=4096, max_requests=64, max_batch_tokens=2048,
                                 chunked_prefill_size=256, max_sequence_length=256, enable_prefix_caching=on)
        engine = DynamicInferenceEngine.from_pretrained(model, config, share_weights=True)
        start = time.perf_counter()
        outs = [o.generated_token_ids for wave in waves for o in engine.generate(wave, params)]
        results[on] = (time.perf_counter() - start, engine.stats(), outs)
    (off_s, off, off_outs), (on_s, on, on_outs) = results[False], results[True]
    saved = off["prefill_tokens"] - on["prefill_tokens"]
    print(f"  caching off: prefilled {off['prefill_tokens']:,} tokens in {off_s:.2f} s")
    print(f"  caching on:  prefilled {on['prefill_tokens']:,} tokens in {on_s:.2f} s; Mamba state hits "
          f"{on['state_prefix_hits']} of {on['state_prefix_lookups']} lookups, {on['state_prefix_backoffs']} backoffs, "
          f"{on['state_snapshots_saved']} snapshots taken")
    print(f"  prefill saved by prefix caching: {saved:,} tokens ({saved / off['prefill_tokens']:.0%}), "
          f"wall {off_s / on_s:.2f}x faster; outputs identical: {on_outs == off_outs}")
    return on_outs == off_outs


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["bamba", "nemotron_h", "falcon_h1"], default="bamba")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--output-len", type=_range, default=(16, 128), help="LOW-HIGH per sample")
    parser.add_argument("--hf-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16])
    parser.add_argument("--systems", type=int, default=8, help="shared prefixes of the prefix-caching workload")
    parser.add_argument("--waves", type=int, default=4, help="requests per shared prefix")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 prompts x n=2, short outputs")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.n, args.output_len, args.hf_batches = 4, 2, (4, 12), [1, 4]
        args.systems, args.waves = 2, 2
    transformers_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    model = hybrid_model(args.family, args.seed)
    print(f"hybrid {args.family} (random init, hidden 256, vocab {VOCAB}), fp32; {machine_line()}")
    ok = bench_throughput(model, args)
    ok &= bench_prefix_cache(model, args)
    print(f"done; {machine_line()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

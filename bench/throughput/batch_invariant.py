"""The batch-invariant mode's cost: GRPO-shaped rollouts of SmolLM2 with `batch_invariant` on against
off, same engine settings, same prompts, same seeds, interleaved pairs, medians.

    .venv/bin/python bench/throughput/batch_invariant.py [--prompts 16] [--n 8] [--pairs 3] [--dtypes float32,bfloat16]

Each pair builds both engines in this process (warmed outside the timing) and times one `generate` of
the whole batch on each, alternating which goes first. Printed per dtype: tokens/s of each and the
ratio on / off (the issue's aim: at most 15% slower, a ratio >= 0.85), and whether the two runs drew
the same tokens (bf16 on CPU is batch-invariant in either mode; fp32 off is not past 128 rows).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.common import machine_line, print_result


def prompts_of(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(200, 40000) for _ in range(rng.randrange(31, 64))] for _ in range(count)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sample (EOS ignored)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    import torch

    from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
    from inference.models.smollm2 import smollm2_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_line(), flush=True)
    batch = prompts_of(args.prompts)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.tokens, ignore_eos=True, seed=0)
    for dtype in args.dtypes.split(","):
        model = smollm2_dir(getattr(torch, dtype))
        engines = {}
        for mode in (False, True):
            config = InferenceConfig(dtype=dtype, block_size=16, num_blocks=4096, max_requests=256,
                                     max_batch_tokens=2048, max_sequence_length=512, batch_invariant=mode)
            engines[mode] = DynamicInferenceEngine.from_pretrained(model, config)
            engines[mode].generate(batch[:2], params)  # NOTE: warm-up outside the timing
        rates: dict[bool, list[float]] = {False: [], True: []}
        tokens: dict[bool, list[list[int]]] = {}
        for pair in range(args.pairs):
            for mode in ((False, True) if pair % 2 == 0 else (True, False)):
                engines[mode].reset_prefix_cache()
                start = time.perf_counter()
                outs = engines[mode].generate(batch, params)
                seconds = time.perf_counter() - start
                rates[mode].append(sum(len(o.generated_token_ids) for o in outs) / seconds)
                tokens[mode] = [o.generated_token_ids for o in outs]
        off, on = statistics.median(rates[False]), statistics.median(rates[True])
        same = tokens[False] == tokens[True]
        print(f"{dtype}: off {off:.1f} tok/s, on {on:.1f} tok/s, on / off {on / off:.3f}, same tokens {same}",
              flush=True)
        print_result("batch_invariant", {"off_tok_s": off, "on_tok_s": on, "on_over_off": on / off},
                     dtype=dtype, prompts=args.prompts, n=args.n, pairs=args.pairs, same_tokens=same)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

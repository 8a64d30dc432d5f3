"""A tiny Llama over the counting task's 16-token vocabulary, and engines around it; the service
tests' server process (started once, when a test first asks for it, and always stopped)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from inference import InferenceConfig
from rollout.rl.tasks import DigitVocab


def tiny_policy(seed: int = 0, hidden: int = 64, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=DigitVocab.SIZE, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=DigitVocab.BOS, eos_token_id=DigitVocab.EOS, pad_token_id=DigitVocab.PAD,
    )
    return LlamaForCausalLM(cfg)


def small_engine_config(block_size: int = 4, num_blocks: int = 512) -> InferenceConfig:
    return InferenceConfig(block_size=block_size, num_blocks=num_blocks, max_requests=128, max_batch_tokens=1024,
                           max_sequence_length=32)


@pytest.fixture
def policy() -> LlamaForCausalLM:
    return tiny_policy()


@pytest.fixture
def no_plot(monkeypatch):
    """The PNG takes longer than a short run: for tests that read the summary or the console only."""
    monkeypatch.setattr("rollout.rl.tracking.plot_history", lambda *args, **kwargs: None)
@pytest.fixture(scope="session")
def service_model_dir(tmp_path_factory):
    from tests.rollout.service_util import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("service-model"))


@pytest.fixture(scope="session")
def server(service_model_dir):
    """A `rollout serve` process with test hooks on an ephemeral loopback port."""
    from rollout import ServerProcess
    from tests.rollout.service_util import HOOKED_ENTRY, SERVER_ARGS, WAIT_S

    proc = ServerProcess(service_model_dir, *SERVER_ARGS, entry=HOOKED_ENTRY, ready_timeout=WAIT_S)
    try:
        yield proc
    finally:
        proc.stop(grace_s=5.0)


@pytest.fixture(scope="session")
def reference(service_model_dir):
    """The in-process engine on the server's weights and configuration."""
    from inference import DynamicInferenceEngine
    from tests.rollout.service_util import engine_config

    return DynamicInferenceEngine.from_pretrained(service_model_dir, engine_config())

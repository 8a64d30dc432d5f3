"""`rollout vllm-serve`: vLLM's `vllm serve` line, its flags accepted, mapped or refused by name, and a
server started from a SkyRL-shaped line of 14 flags driven over HTTP."""

from __future__ import annotations

import httpx
import pytest

from rollout.server.launch_lines import LaunchLineError, normalized
from rollout.server.vllm_serve import REFUSED, serve_args
from tests.rollout.http_util import WAIT_S, save_tiny_chat_model


def test_mixed_spellings_are_vllm_s_names():
    assert normalized(["--max-num_batched_tokens=8", "--max_model_len", "64", "/m_dir", "-h"]) == [
        "--max-num-batched-tokens=8", "--max-model-len", "64", "/m_dir", "-h"]


def test_every_accepted_flag_takes_effect():
    a = serve_args(["smollm2", "--host", "127.0.0.1", "--port", "8011", "--served-model-name", "policy", "alias",
                    "--api-key", "k", "--dtype", "half", "--seed", "7", "--max-model-len", "1024",
                    "--max-num-seqs", "32", "--max_num_batched_tokens", "512", "--no-enable-prefix-caching",
                    "--enable-chunked-prefill", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                    "--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--skip-tokenizer-init",
                    "--enable-prompt-tokens-details", "--enable-sleep-mode", "--no-enable-log-requests",
                    "--disable-log-stats", "--uvicorn-log-level", "warning", "--threads", "1",
                    "--return_tokens_as_token_ids"])
    assert (a.model, a.http, a.http_host, a.host, a.port) == ("smollm2", 8011, "127.0.0.1", "127.0.0.1", 0)
    assert a.served_model_name == ["policy", "alias"] and a.api_key == "k" and a.dtype == "float16"
    assert (a.seed, a.max_seq_len, a.max_requests, a.max_batch_tokens) == (7, 1024, 32, 512)
    assert a.enable_prefix_caching is False and a.chunked_prefill_size == 512  # NOTE: a chunk fits one step
    assert (a.max_loras, a.max_lora_rank, a.tool_call_parser) == (2, 16, "hermes")
    assert a.skip_tokenizer_init and a.enable_prompt_tokens_details and a.threads == 1
    assert a.return_tokens_as_token_ids and not serve_args(["smollm2"]).return_tokens_as_token_ids


def test_defaults_are_vllm_s():
    a = serve_args(["smollm2"])
    assert (a.http, a.http_host, a.dtype, a.max_seq_len, a.max_requests, a.max_batch_tokens) == (
        8000, "127.0.0.1", "auto", 4096, 256, 2048)
    assert a.enable_prefix_caching and a.max_loras == 0  # NOTE: no --enable-lora: the LoRA routes refuse
    assert a.kv_memory_bytes is None and a.seed is None and a.generation_config == "auto"
    assert serve_args(["smollm2", "--generation-config", "vllm"]).generation_config == "vllm"


def test_chunked_prefill_off_prefills_a_prompt_whole():
    args = serve_args(["smollm2", "--max-model-len", "3000", "--no-enable-chunked-prefill"])
    assert args.chunked_prefill_size == 3000


def test_gpu_flags_map_to_this_machine():
    a = serve_args(["smollm2", "--gpu-memory-utilization", "0.25", "--tensor-parallel-size", "1", "--enforce-eager",
                    "--distributed-executor-backend", "mp"], free_bytes=8 * 2**30)
    assert a.kv_memory_bytes == 2 * 2**30  # NOTE: the KV pool: that fraction of the memory free at start
    with pytest.raises(LaunchLineError, match="--tensor-parallel-size 4: one engine process"):
        serve_args(["smollm2", "--tensor-parallel-size", "4"])
    with pytest.raises(LaunchLineError, match="a fraction in"):
        serve_args(["smollm2", "--gpu-memory-utilization", "1.5"], free_bytes=1)


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_a_refused_flag_says_which_and_why(flag):
    line = ["smollm2", flag] + ([] if flag == "--trust-remote-code" else ["x"])
    with pytest.raises(LaunchLineError) as info:
        serve_args(line)
    assert str(info.value) == f"{flag}: {REFUSED[flag]}"


def test_a_hub_id_an_open_host_without_key_and_an_unknown_flag_are_refused(capsys):
    with pytest.raises(LaunchLineError, match="no model hub here"):
        serve_args(["Qwen/Qwen2.5-0.5B-Instruct"])
    with pytest.raises(LaunchLineError, match="--host 0.0.0.0 without --api-key"):
        serve_args(["smollm2", "--host", "0.0.0.0"])
    assert serve_args(["smollm2", "--host", "0.0.0.0", "--api-key", "k"]).http_host == "0.0.0.0"
    with pytest.raises(SystemExit) as info:
        serve_args(["smollm2", "--speculative-config", "{}"])
    assert info.value.code == 2 and "--speculative-config" in capsys.readouterr().err


def test_a_server_from_a_skyrl_shaped_line(tmp_path):
    from transformers import AutoModelForCausalLM

    from rollout import ServerProcess
    from rollout.server.serve import READY_PREFIX
    from tests.inference.lora.peft_adapters import save_adapter

    model = save_tiny_chat_model(tmp_path / "tiny")
    (model / "generation_config.json").write_text('{"temperature": 0.0, "top_p": 0.9, "bos_token_id": 1}')
    adapter = save_adapter(AutoModelForCausalLM.from_pretrained(model), tmp_path / "lora", r=4, alpha=8,
                           targets=["q_proj"], seed=1)
    line = [str(model), "--served-model-name", "policy", "--api-key", "secret", "--dtype", "float32", "--seed", "42",
            "--max-model-len", "96", "--max-num-seqs", "8", "--max_num_batched_tokens", "256",
            "--enable-prefix-caching", "--no-enable-chunked-prefill", "--enable-sleep-mode",
            "--gpu-memory-utilization", "0.01", "--tensor-parallel-size", "1", "--enforce-eager",
            "--distributed-executor-backend", "mp", "--threads", "1", "--return-tokens-as-token-ids"]
    proc = ServerProcess(None, *line, entry=("-m", "rollout.cli", "vllm-serve"), ready_prefix=READY_PREFIX,
                         ready_timeout=WAIT_S)
    try:
        assert proc.http_url is not None, "\n".join(proc.output)
        key = {"Authorization": "Bearer secret"}
        with httpx.Client(base_url=proc.http_url, timeout=WAIT_S) as web:
            assert web.get("/v1/models").status_code == 401  # NOTE: --api-key holds
            assert [m["id"] for m in web.get("/v1/models", headers=key).json()["data"]] == ["policy"]
            done = web.post("/v1/completions", headers=key,
                            json={"model": "policy", "prompt": [1, 5, 9], "max_tokens": 4, "ignore_eos": True})
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
            # NOTE: --generation-config auto (vLLM's default): the model's temperature 0 for requests without one
            again = web.post("/v1/completions", headers=key, json={"model": "policy", "prompt": [1, 5, 9],
                                                                   "max_tokens": 4, "ignore_eos": True})
            assert again.json()["choices"][0]["text"] == done.json()["choices"][0]["text"]
            body = {"model": "policy", "prompt": [1, 5], "max_tokens": 2, "logprobs": 1}
            tokens = web.post("/v1/completions", headers=key, json=body).json()["choices"][0]["logprobs"]["tokens"]
            assert all(t.startswith("token_id:") for t in tokens)  # NOTE: --return-tokens-as-token-ids
            body["return_tokens_as_token_ids"] = False  # NOTE: a request may say otherwise
            tokens = web.post("/v1/completions", headers=key, json=body).json()["choices"][0]["logprobs"]["tokens"]
            assert not any(t.startswith("token_id:") for t in tokens)
            too_long = web.post("/v1/completions", headers=key,
                                json={"model": "policy", "prompt": list(range(3, 95)), "max_tokens": 8})
            assert too_long.status_code == 400  # NOTE: --max-model-len 96
            assert web.get("/is_sleeping", headers=key).status_code == 200  # NOTE: the sleep routes serve
            refused = web.post("/v1/load_lora_adapter", headers=key, json={"lora_name": "a", "lora_path": str(adapter)})
            assert refused.status_code >= 400 and "max_loras=0" in refused.text  # NOTE: no --enable-lora, as vLLM
    finally:
        proc.stop(grace_s=5.0)


def test_generation_config_defaults_fill_only_what_a_request_leaves_unset(tmp_path):
    from types import SimpleNamespace

    from rollout.http.sampling import generation_defaults, sampling_params

    (tmp_path / "generation_config.json").write_text(
        '{"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.05, "do_sample": true}')
    defaults = generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.05}
    assert generation_defaults(tmp_path / "absent") == {}
    codec = SimpleNamespace(vocab_size=100)
    fields = dict(temperature=None, top_p=None, top_k=None, min_p=None, seed=None, stop_token_ids=None,
                  ignore_eos=False, logprobs_mode=None, logit_bias=None, bad_words=None, allowed_token_ids=None)
    unset = sampling_params(codec, SimpleNamespace(**fields), n=1, max_tokens=4, logprobs=None, defaults=defaults)
    assert (unset.temperature, unset.top_k, unset.top_p, unset.repetition_penalty) == (0.6, 20, 0.95, 1.05)
    given = sampling_params(codec, SimpleNamespace(**{**fields, "temperature": 1.0, "top_k": -1}), n=1, max_tokens=4,
                            logprobs=None, defaults=defaults)
    assert (given.temperature, given.top_k, given.top_p) == (1.0, -1, 0.95)  # NOTE: -1 as sent: off
    plain = sampling_params(codec, SimpleNamespace(**fields), n=1, max_tokens=4, logprobs=None)
    assert (plain.temperature, plain.top_k, plain.top_p) == (1.0, 0, 1.0)

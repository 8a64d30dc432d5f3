"""`rollout vllm-serve`: vLLM's `vllm serve` line, its flags accepted, mapped or refused by name, and a
server started from a SkyRL-shaped line of 14 flags driven over HTTP."""

from __future__ import annotations

import os
import re

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
    from rollout.server.serve import HTTP_READY_PREFIX
    from tests.inference.lora.peft_adapters import save_adapter

    model = save_tiny_chat_model(tmp_path / "tiny")
    (model / "generation_config.json").write_text('{"temperature": 0.0, "top_p": 0.9, "bos_token_id": 1, '
                                                  '"max_new_tokens": 6}')
    adapter = save_adapter(AutoModelForCausalLM.from_pretrained(model), tmp_path / "lora", r=4, alpha=8,
                           targets=["q_proj"], seed=1)
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    line = [str(model), "--served-model-name", "policy", "--api-key", "secret", "--dtype", "float32", "--seed", "42",
            "--max-model-len", "96", "--max-num-seqs", "8", "--max_num_batched_tokens", "256",
            "--enable-prefix-caching", "--no-enable-chunked-prefill", "--enable-sleep-mode",
            "--gpu-memory-utilization", "0.01", "--tensor-parallel-size", "1", "--enforce-eager",
            "--distributed-executor-backend", "mp", "--threads", "1", "--return-tokens-as-token-ids",
            "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"sql={adapter}", "--max-logprobs", "3",
            "--chat-template", str(template), "--weight-transfer-config", '{"backend": "nccl"}',
            "--worker-extension-cls", "skyrl_train.inference_engines.vllm.vllm_engine.WorkerWrap"]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # NOTE: as SkyRL's launch sets it; runtime LoRA left off
    proc = ServerProcess(None, *line, entry=("-m", "rollout.cli", "vllm-serve"), ready_prefix=HTTP_READY_PREFIX,
                         ready_timeout=WAIT_S, env=env)
    try:
        assert proc.http_url is not None and proc.address == proc.http_url, "\n".join(proc.output)
        assert not any("rollout serve: listening on" in line for line in proc.output)  # NOTE: no ZMQ port bound
        key = {"Authorization": "Bearer secret"}
        with httpx.Client(base_url=proc.http_url, timeout=WAIT_S) as web:
            assert web.get("/v1/models").status_code == 401  # NOTE: --api-key holds
            assert [m["id"] for m in web.get("/v1/models", headers=key).json()["data"]] == ["policy", "sql"]
            done = web.post("/v1/completions", headers=key,
                            json={"model": "policy", "prompt": [1, 5, 9], "max_tokens": 4, "ignore_eos": True})
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
            # NOTE: --generation-config auto (vLLM's default): the model's temperature 0 for requests without one
            again = web.post("/v1/completions", headers=key, json={"model": "policy", "prompt": [1, 5, 9],
                                                                   "max_tokens": 4, "ignore_eos": True})
            assert again.json()["choices"][0]["text"] == done.json()["choices"][0]["text"]
            capped = web.post("/v1/completions", headers=key, json={"model": "policy", "prompt": [1, 5, 9],
                                                                    "max_tokens": 50, "ignore_eos": True})
            assert capped.json()["usage"]["completion_tokens"] == 6  # NOTE: its max_new_tokens caps, as vLLM's
            on_adapter = web.post("/v1/completions", headers=key, json={"model": "sql", "prompt": [1, 5, 9],
                                                                        "max_tokens": 2, "ignore_eos": True})
            assert on_adapter.status_code == 200 and on_adapter.json()["model"] == "sql"  # NOTE: --lora-modules
            body = {"model": "policy", "prompt": [1, 5], "max_tokens": 2, "logprobs": 1}
            tokens = web.post("/v1/completions", headers=key, json=body).json()["choices"][0]["logprobs"]["tokens"]
            assert all(t.startswith("token_id:") for t in tokens)  # NOTE: --return-tokens-as-token-ids
            body["return_tokens_as_token_ids"] = False  # NOTE: a request may say otherwise
            tokens = web.post("/v1/completions", headers=key, json=body).json()["choices"][0]["logprobs"]["tokens"]
            assert not any(t.startswith("token_id:") for t in tokens)
            too_many = web.post("/v1/completions", headers=key, json={**body, "logprobs": 4})
            assert too_many.status_code == 400 and "greater than max allowed: 3" in too_many.text  # --max-logprobs
            rendered = web.post("/tokenize", headers=key, json={"model": "policy", "add_generation_prompt": False,
                                                                "messages": [{"role": "user", "content": "hi"}]})
            text = web.post("/tokenize", headers=key, json={"model": "policy", "prompt": "<user>hi",
                                                            "add_special_tokens": False})
            assert rendered.json()["tokens"] == text.json()["tokens"]  # NOTE: --chat-template's text, not the model's
            chat = web.post("/v1/chat/completions", headers=key,
                            json={"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
            assert chat.status_code == 200  # NOTE: --chat-template's own template renders it
            too_long = web.post("/v1/completions", headers=key,
                                json={"model": "policy", "prompt": list(range(3, 95)), "max_tokens": 8})
            assert too_long.status_code == 400  # NOTE: --max-model-len 96
            assert web.get("/is_sleeping", headers=key).status_code == 200  # NOTE: VLLM_SERVER_DEV_MODE=1
            closed = web.post("/v1/load_lora_adapter", headers=key, json={"lora_name": "a", "lora_path": str(adapter)})
            assert closed.status_code == 404  # NOTE: no VLLM_ALLOW_RUNTIME_LORA_UPDATING, as vLLM's
    finally:
        proc.stop(grace_s=5.0)


def test_a_server_from_a_config_file_with_dummy_weights(tmp_path):
    from rollout import ServerProcess
    from rollout.server.serve import READY_PREFIX

    model = save_tiny_chat_model(tmp_path / "tiny")
    (tmp_path / "serve.yaml").write_text(f"model: {model}\nserved-model-name: [a, b]\nmax_num_seqs: 4\n"
                                         "load-format: dummy\nenable-prefix-caching: false\nseed: 3\n"
                                         "max-model-len: 64\nthreads: 1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    proc = ServerProcess(None, "--config", str(tmp_path / "serve.yaml"), "--max-model-len", "80",
                         "--rollout-zmq-port", "0", entry=("-m", "rollout.cli", "vllm-serve"),
                         ready_prefix=READY_PREFIX, ready_timeout=WAIT_S, env=env)
    try:
        assert proc.http_url is not None and proc.address.startswith("tcp://127.0.0.1:")  # NOTE: ZMQ as asked
        with httpx.Client(base_url=proc.http_url, timeout=WAIT_S) as web:
            assert [m["id"] for m in web.get("/v1/models").json()["data"]] == ["a", "b"]
            assert web.get("/v1/models").json()["data"][0]["max_model_len"] == 80  # NOTE: the line's own wins
            out = web.post("/v1/completions", json={"model": "b", "prompt": [1, 5, 9], "max_tokens": 3,
                                                    "ignore_eos": True})
            assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
            assert web.post("/sleep").status_code == 404  # NOTE: no VLLM_SERVER_DEV_MODE: vLLM's dev routes absent
            assert web.post("/collective_rpc", json={"method": "x"}).status_code == 404
    finally:
        proc.stop(grace_s=5.0)


def test_dummy_weights_are_random_and_seeded(tmp_path):
    import torch

    from rollout.server.serve import random_model

    model = save_tiny_chat_model(tmp_path / "tiny")
    torch.manual_seed(3)
    first = random_model(model).state_dict()
    torch.manual_seed(3)
    again = random_model(model).state_dict()
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(model).state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(first[name], again[name]) and not torch.equal(first[name], saved[name])


def test_the_new_flags_map_or_refuse(tmp_path):
    model = save_tiny_chat_model(tmp_path / "tiny")
    paths = serve_args([str(model), "--tokenizer", str(model), "--chat-template", "{{ messages }}"], environ={})
    assert (paths.tokenizer, paths.chat_template) == (str(model), "{{ messages }}")
    a = serve_args(["smollm2", "--max-logprobs", "-1", "--logprobs-mode", "processed_logprobs",
                    "--load-format", "safetensors", "--enable-lora", "--lora-modules", "x=/a",
                    '{"name": "y", "path": "/b", "base_model_name": "smollm2"}'], environ={})
    assert (a.max_logprobs, a.logprobs_mode, a.load_format) == (100, "processed", "safetensors")
    assert a.lora_modules == ["x=/a", "y=/b"] and not a.zmq and "/sleep" in a.close_route
    assert "/v1/load_lora_adapter" in a.close_route
    opened = serve_args(["smollm2"], environ={"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert opened.close_route == [] and not opened.batch_invariant
    assert serve_args(["smollm2"], environ={"VLLM_BATCH_INVARIANT": "1"}).batch_invariant  # NOTE: vLLM's mode
    for line, message in [
            (["--logprobs-mode", "raw_logits"], "--logprobs-mode raw_logits: one of raw_logprobs, processed_logprobs"),
            (["--load-format", "pt"], "--load-format pt: one of"),
            (["--max-logprobs", "101"], "--max-logprobs 101: at most 100"),
            (["--lora-modules", "x=/a"], "needs --enable-lora"),
            (["--enable-lora", "--lora-modules", '{"name": "y", "path": "/b", "base_model_name": "other"}'],
             "base_model_name 'other' is not a served name"),
            (["--weight-transfer-config", '{"backend": "ipc"}'], "nothing pickled is loaded here"),
            (["--weight-transfer-config", '{"backend": "nccl", "x": 1}'], "takes"),
            (["--tokenizer", "Qwen/Qwen2.5-0.5B"], "no model hub here"), (["--tokenizer", "smollm2"], "no model hub")]:
        with pytest.raises(LaunchLineError, match=re.escape(message)):
            serve_args(["smollm2", *line], environ={})
    with pytest.raises(LaunchLineError, match="VLLM_SERVER_DEV_MODE"):
        serve_args(["smollm2"], environ={"VLLM_SERVER_DEV_MODE": "yes"})


def test_a_config_file_gives_flags_by_name(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: smollm2\nmax_num_seqs: 8\nenable-prefix-caching: false\nserved-model-name: [p, q]\n"
                    "weight-transfer-config: {backend: nccl}\n")
    a = serve_args(["--config", str(path), "--max-num-seqs", "16"], environ={})
    assert (a.model, a.max_requests, a.enable_prefix_caching, a.served_model_name) == ("smollm2", 16, False, ["p", "q"])
    path.write_text("- a list\n")
    with pytest.raises(LaunchLineError, match="a YAML mapping"):
        serve_args(["--config", str(path)], environ={})


def test_generation_config_defaults_fill_only_what_a_request_leaves_unset(tmp_path):
    from types import SimpleNamespace

    from rollout.http.core.sampling import generation_defaults, sampling_params

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


def test_http_only_needs_an_http_port(capsys):
    import argparse

    from rollout.server.serve import add_serve_arguments, serve_main

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert serve_main(parser.parse_args(["--model", "smollm2", "--no-zmq"])) == 2
    assert "--no-zmq serves HTTP only: give --http PORT" in capsys.readouterr().err

"""`rollout sglang-serve` / `python -m rollout.sglang_launch_server`: SGLang's `launch_server` line, its
flags accepted, mapped or refused by name, and a server started from a slime-shaped line of 10 flags
driven over SGLang's routes."""

from __future__ import annotations

import httpx
import pytest

from rollout.server.launch_lines import LaunchLineError
from rollout.server.sglang_serve import serve_args
from tests.rollout.http_util import WAIT_S, save_tiny_chat_model


def test_every_accepted_flag_takes_effect():
    a = serve_args(["--model-path", "smollm2", "--host", "127.0.0.1", "--port", "30011", "--served-model-name", "p",
                    "--api-key", "k", "--dtype", "bfloat16", "--context_length", "1024", "--max-running-requests",
                    "48", "--chunked-prefill-size", "256", "--disable-radix-cache", "--random-seed", "3",
                    "--skip-tokenizer-init", "--enable-memory-saver", "--log-level", "warning", "--tp-size", "1",
                    "--dp-size", "1", "--threads", "1", "--enable-deterministic-inference"])
    assert (a.model, a.http, a.http_host, a.host, a.port) == ("smollm2", 30011, "127.0.0.1", "127.0.0.1", 0)
    assert a.served_model_name == ["p"] and a.api_key == "k" and a.dtype == "bfloat16"
    assert (a.max_seq_len, a.max_requests, a.chunked_prefill_size, a.seed) == (1024, 48, 256, 3)
    assert a.enable_prefix_caching is False and a.skip_tokenizer_init and a.threads == 1 and a.batch_invariant


def test_defaults_and_mapped_flags():
    a = serve_args(["--model-path", "smollm2"])
    assert (a.http, a.dtype, a.max_seq_len, a.enable_prefix_caching, a.kv_memory_bytes) == (30000, "auto", 4096,
                                                                                             True, None)
    assert serve_args(["--model-path", "smollm2", "--chunked-prefill-size", "-1"]).chunked_prefill_size == 4096
    half = serve_args(["--model-path", "smollm2", "--mem-fraction-static", "0.5", "--dtype", "half"],
                      free_bytes=4 * 2**30)
    assert half.kv_memory_bytes == 2 * 2**30 and half.dtype == "float16"


@pytest.mark.parametrize("line,message", [
    (["--tp-size", "2"], "--tp-size 2: one engine process"),
    (["--tensor-parallel-size", "2"], "--tp-size 2: one engine process"),
    (["--dp-size", "4"], "--dp-size 4: one engine process"),
    (["--trust-remote-code"], "--trust-remote-code: no remote code runs here"),
    (["--host", "0.0.0.0"], "--host 0.0.0.0 without --api-key"),
    (["--mem-fraction-static", "0"], "--mem-fraction-static 0.0: a fraction in"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size 0: a positive size, or -1"),
])
def test_refused_flags_say_which_and_why(line, message):
    with pytest.raises(LaunchLineError, match=message):
        serve_args(["--model-path", "smollm2", *line], free_bytes=2**30)


def test_a_hub_id_and_an_unknown_flag_are_refused(capsys):
    with pytest.raises(LaunchLineError, match="--model-path Qwen/Qwen3-4B: not a local HF model directory"):
        serve_args(["--model-path", "Qwen/Qwen3-4B"])
    with pytest.raises(SystemExit) as info:
        serve_args(["--model-path", "smollm2", "--enable-dp-attention"])
    assert info.value.code == 2 and "--enable-dp-attention" in capsys.readouterr().err


def test_a_server_from_a_slime_shaped_line(tmp_path):
    from rollout import ServerProcess
    from rollout.server.serve import HTTP_READY_PREFIX

    model = save_tiny_chat_model(tmp_path / "tiny")
    line = ["--model-path", str(model), "--served-model-name", "actor", "--api-key", "secret", "--dtype", "float32",
            "--context-length", "96", "--max-running-requests", "8", "--mem-fraction-static", "0.01",
            "--tp-size", "1", "--enable-memory-saver", "--random-seed", "1", "--log-level", "warning",
            "--threads", "1"]
    proc = ServerProcess(None, *line, entry=("-m", "rollout.sglang_launch_server"), ready_timeout=WAIT_S,
                         ready_prefix=HTTP_READY_PREFIX)
    try:
        assert proc.http_url is not None, "\n".join(proc.output)
        assert not any("rollout serve: listening on" in line for line in proc.output)  # NOTE: only HTTP is bound
        key = {"Authorization": "Bearer secret"}
        with httpx.Client(base_url=proc.http_url, timeout=WAIT_S) as web:
            assert web.get("/get_server_info").status_code == 401  # NOTE: --api-key holds
            info = web.get("/get_server_info", headers=key).json()
            assert (info["served_model_name"], info["context_length"], info["max_running_requests"]) == ("actor", 96, 8)
            done = web.post("/generate", headers=key, json={"input_ids": [1, 5, 9], "sampling_params": {
                "max_new_tokens": 4, "ignore_eos": True}})
            assert done.status_code == 200 and len(done.json()["output_ids"]) == 4
            too_long = web.post("/generate", headers=key, json={"input_ids": list(range(3, 95)),
                                                                "sampling_params": {"max_new_tokens": 8}})
            assert too_long.status_code == 400  # NOTE: --context-length 96
            for route in ("/release_memory_occupation", "/resume_memory_occupation"):
                assert web.post(route, headers=key, json={}).status_code == 200, route
    finally:
        proc.stop(grace_s=5.0)

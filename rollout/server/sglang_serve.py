"""`rollout sglang-serve [flags]` (and `python -m rollout.sglang_launch_server`): a server started by the
line a framework builds for SGLang's `python -m sglang.launch_server`.

    python -m sglang.launch_server --model-path /ckpt --port 30001 --mem-fraction-static 0.7 --tp-size 1
    python -m rollout.sglang_launch_server --model-path /ckpt --port 30001 --mem-fraction-static 0.7 --tp-size 1

SGLang 0.5's names (and their underscore spellings), translated into `rollout serve`'s arguments as
`vllm_serve.py` does: `--port` is the HTTP port (SGLang's routes and OpenAI's) and the only one
bound (the engine's ZMQ server only with `--rollout-zmq-port`); each flag accepted with its
effect, mapped, or refused with the reason; unknown flags are errors naming them.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

from rollout.server.launch_lines import (
    DTYPES,
    LaunchLineError,
    add_own_arguments,
    check_host,
    check_model,
    check_one,
    kv_bytes,
    normalized,
    run,
    serve_namespace,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout sglang-serve", allow_abbrev=False,
                                description="SGLang's `launch_server` command line, served by this engine "
                                "(rollout.server.sglang_serve)")
    p.add_argument("--model-path", required=True, help="a local HF model directory, or `smollm2` (no model hub)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address (beyond loopback needs --api-key)")
    p.add_argument("--port", type=int, default=30000, help="HTTP port (0: one the OS chooses, printed)")
    p.add_argument("--served-model-name", help="the `model` name clients may send")
    p.add_argument("--api-key", default=os.environ.get("SGLANG_API_KEY"), help="required bearer key")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="auto", help="auto: the checkpoint's dtype")
    p.add_argument("--context-length", type=int, help="longest prompt + completion (default 4096)")
    p.add_argument("--max-running-requests", type=int, help="requests in flight at once (default 256)")
    p.add_argument("--chunked-prefill-size", type=int, help="a prefill chunk's tokens (-1: a prompt in one chunk)")
    p.add_argument("--disable-radix-cache", action="store_true", help="no prefix cache")
    p.add_argument("--random-seed", type=int, help="seeds the sampling of requests that carry no seed")
    p.add_argument("--skip-tokenizer-init", action="store_true", help="token ids in and out only")
    p.add_argument("--enable-memory-saver", action="store_true",
                   help="accepted: /release_memory_occupation and /resume_memory_occupation always serve")
    p.add_argument("--log-level", default="info", help="accepted: the HTTP front logs errors only")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="the engine's batch_invariant mode: a request's tokens the same bits whatever shares its steps")
    gpu = p.add_argument_group("GPU flags, mapped to what they mean on this machine")
    gpu.add_argument("--mem-fraction-static", type=float,
                     help="the KV pool: this fraction of the memory free when the server starts")
    gpu.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1,
                     help="1 only: one engine process, no shards")
    gpu.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1,
                     help="1 only: start one server per replica")
    add_own_arguments(p)
    p.add_argument("--trust-remote-code", action="store_const", const=True, default=None, help=argparse.SUPPRESS)
    return p


def serve_args(argv: list[str], free_bytes: Optional[int] = None) -> argparse.Namespace:
    """`rollout serve`'s arguments for a `launch_server` line; raises `LaunchLineError` for a flag it
    refuses and exits as argparse does (status 2) for an unknown one."""
    s = build_parser().parse_args(normalized(argv))
    if s.trust_remote_code:
        raise LaunchLineError("--trust-remote-code: no remote code runs here: the model's architecture must be one "
                              "the engine implements")
    check_one("--tp-size", s.tp_size, "start one server per replica; `rollout route` spreads requests over them")
    check_one("--dp-size", s.dp_size, "start one server per replica; `rollout route` spreads requests over them")
    check_host(s.host, s.api_key, "SGLANG_API_KEY")
    check_model(s.model_path, "--model-path ")
    max_len = s.context_length or 4096
    chunk = max_len if s.chunked_prefill_size in (None, -1) else s.chunked_prefill_size
    if chunk < 1:
        raise LaunchLineError(f"--chunked-prefill-size {s.chunked_prefill_size}: a positive size, or -1 (off)")
    kv = None if s.mem_fraction_static is None else kv_bytes(s.mem_fraction_static, "--mem-fraction-static",
                                                             free_bytes)
    line = ["--model", s.model_path, "--host", "127.0.0.1", "--port", str(s.rollout_zmq_port or 0),
            "--http", str(s.port), "--http-host", s.host, "--dtype", DTYPES[s.dtype], "--device", s.device,
            "--chunked-prefill-size", str(min(chunk, max_len))]
    return serve_namespace(line, {
        "--served-model-name": None if s.served_model_name is None else [s.served_model_name],
        "--api-key": s.api_key, "--seed": s.random_seed, "--max-seq-len": s.context_length,
        "--max-requests": s.max_running_requests, "--threads": s.threads, "--kv-memory-bytes": kv,
        "--no-prefix-caching": s.disable_radix_cache, "--skip-tokenizer-init": s.skip_tokenizer_init,
        "--no-zmq": s.rollout_zmq_port is None, "--batch-invariant": s.enable_deterministic_inference})


def main(argv: list[str]) -> int:
    return run("sglang-serve", serve_args, argv)

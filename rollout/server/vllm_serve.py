"""`rollout vllm-serve MODEL [flags]`: a server started by the line a framework builds for `vllm serve`.

    vllm serve /ckpt --port 8001 --dtype bfloat16 --max-model-len 4096 --enable-prefix-caching
    rollout vllm-serve /ckpt --port 8001 --dtype bfloat16 --max-model-len 4096 --enable-prefix-caching

vLLM 0.33's syntax and meanings (flags by its names or their underscore spellings, mixed ones too:
`--max-num_batched_tokens`), translated into `rollout serve`'s arguments (`rollout.server.serve`):
`--port` is the HTTP port, as in vLLM; the engine's ZMQ server listens on an OS-chosen loopback
port (printed), or `--rollout-zmq-port`. Each flag is accepted (with its effect), mapped (a GPU
flag, to what it means on this machine) or refused with the reason; an unknown flag is an error
naming it. Nothing is silently ignored. The model is a local HF directory or `smollm2`: there is no
model hub here.
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

# vLLM flags this entry does not take yet, each refused with this reason (issue 62 goes on)
NOT_YET = "not taken by `rollout vllm-serve` yet"
REFUSED = {
    "--trust-remote-code": "no remote code runs here: the model's architecture must be one the engine implements",
    "--lora-modules": NOT_YET + " (load adapters over HTTP: /v1/load_lora_adapter)",
    "--max-logprobs": NOT_YET,
    "--weight-transfer-config": NOT_YET + " (the weight routes take their transport per call)",
    "--logprobs-mode": NOT_YET + " (per request: the `logprobs_mode` field)",
    "--chat-template": NOT_YET + " (the model directory's template serves)",
    "--tokenizer": NOT_YET + " (the model directory's tokenizer serves)",
    "--load-format": NOT_YET,
    "--worker-extension-cls": NOT_YET,
    "--config": NOT_YET,
    "--pipeline-parallel-size": "one process serves the whole model, without pipeline stages: leave it out",
    "--data-parallel-size": "start one server per replica (and `rollout route` over them)",
}
SWITCHES = {"--trust-remote-code"}  # the refused flags that take no value

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout vllm-serve", allow_abbrev=False,
                                description="vLLM's `vllm serve` command line, served by this engine "
                                "(rollout.server.vllm_serve)")
    p.add_argument("model", help="a local HF model directory, or `smollm2` (no model hub here)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address (beyond loopback needs --api-key)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: one the OS chooses, printed)")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME", help="the `model` names clients may send")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"), help="required bearer key ($VLLM_API_KEY)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="auto", help="auto: the checkpoint's dtype")
    p.add_argument("--seed", type=int, help="seeds the sampling of requests that carry no seed")
    p.add_argument("--max-model-len", type=int, help="longest prompt + completion (default 4096)")
    p.add_argument("--max-num-seqs", type=int, help="requests in flight at once (default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens in one step (default 2048)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="off: each prompt's prefill in one chunk (up to --max-model-len tokens)")
    p.add_argument("--enable-sleep-mode", action="store_true", help="accepted: /sleep and /wake_up always serve")
    p.add_argument("--enable-lora", action="store_true", help="without it the LoRA routes refuse, as vLLM's")
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="accepted: usage.prompt_tokens_details.cached_tokens is always reported")
    from rollout.http.tools import TOOL_PARSERS

    p.add_argument("--tool-call-parser", choices=TOOL_PARSERS, default="none")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted: `tool_choice: auto` is served wherever a --tool-call-parser is")
    p.add_argument("--skip-tokenizer-init", action="store_true", help="token ids in and out only")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name tokens as `token_id:N` unless a request says otherwise")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults for requests that leave them unset: auto (default), the model's "
                   "generation_config.json; DIR, that directory's; vllm: none")
    p.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="accepted: requests are not logged either way")
    p.add_argument("--disable-log-stats", action="store_true", help="accepted: stats are served at /metrics")
    p.add_argument("--uvicorn-log-level", default="info", help="accepted: the HTTP front logs errors only")
    gpu = p.add_argument_group("GPU flags, mapped to what they mean on this machine")
    gpu.add_argument("--gpu-memory-utilization", type=float,
                     help="the KV pool: this fraction of the memory free when the server starts")
    gpu.add_argument("--tensor-parallel-size", type=int, default=1, help="1 only: one engine process, no shards")
    gpu.add_argument("--enforce-eager", action="store_true", help="accepted: no CUDA graphs on CPU")
    gpu.add_argument("--distributed-executor-backend", help="accepted: the engine runs in this one process")
    add_own_arguments(p)
    for flag in REFUSED:  # NOTE: parsed (so the refusal can name them), then refused in `serve_args`
        if flag in SWITCHES:
            p.add_argument(flag, action="store_const", const=True, default=None, help=argparse.SUPPRESS)
        else:
            p.add_argument(flag, nargs="+", default=None, help=argparse.SUPPRESS)
    return p


def serve_args(argv: list[str], free_bytes: Optional[int] = None) -> argparse.Namespace:
    """`rollout serve`'s arguments for a `vllm serve` line (its arguments after `serve`); raises
    `LaunchLineError` for a flag it refuses and exits as argparse does (status 2) for an unknown one."""
    v = build_parser().parse_args(normalized(argv))
    for flag in REFUSED:
        if getattr(v, flag[2:].replace("-", "_")) is not None:
            raise LaunchLineError(f"{flag}: {REFUSED[flag]}")
    check_one("--tensor-parallel-size", v.tensor_parallel_size,
              "start one server per replica; `rollout route` spreads requests over them")
    check_host(v.host, v.api_key, "VLLM_API_KEY")
    check_model(v.model, "")
    max_len = v.max_model_len or 4096
    chunk = min(v.max_num_batched_tokens or 2048, max_len) if v.enable_chunked_prefill else max_len
    kv = None if v.gpu_memory_utilization is None else kv_bytes(v.gpu_memory_utilization, "--gpu-memory-utilization",
                                                                free_bytes)
    line = ["--model", v.model, "--host", "127.0.0.1", "--port", str(v.rollout_zmq_port), "--http", str(v.port),
            "--http-host", v.host, "--dtype", DTYPES[v.dtype], "--device", v.device,
            "--max-loras", str(v.max_loras if v.enable_lora else 0), "--max-lora-rank", str(v.max_lora_rank),
            "--tool-call-parser", v.tool_call_parser, "--chunked-prefill-size", str(chunk),
            "--generation-config", v.generation_config]
    return serve_namespace(line, {
        "--served-model-name": v.served_model_name, "--api-key": v.api_key, "--seed": v.seed,
        "--max-seq-len": v.max_model_len, "--max-requests": v.max_num_seqs,
        "--max-batch-tokens": v.max_num_batched_tokens, "--threads": v.threads, "--kv-memory-bytes": kv,
        "--no-prefix-caching": not v.enable_prefix_caching, "--skip-tokenizer-init": v.skip_tokenizer_init,
        "--enable-prompt-tokens-details": v.enable_prompt_tokens_details,
        "--return-tokens-as-token-ids": v.return_tokens_as_token_ids})


def main(argv: list[str]) -> int:
    return run("vllm-serve", serve_args, argv)

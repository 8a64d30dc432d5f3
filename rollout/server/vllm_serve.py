"""`rollout vllm-serve MODEL [flags]`: a server started by the line a framework builds for `vllm serve`.

    vllm serve /ckpt --port 8001 --dtype bfloat16 --max-model-len 4096 --enable-prefix-caching
    rollout vllm-serve /ckpt --port 8001 --dtype bfloat16 --max-model-len 4096 --enable-prefix-caching

vLLM 0.33's syntax and meanings (flags by its names or their underscore spellings, mixed ones too:
`--max-num_batched_tokens`), translated into `rollout serve`'s arguments (`rollout.server.serve`):
`--port` is the HTTP port, as in vLLM, and the only one bound: the engine's ZMQ server listens only
when asked (`--rollout-zmq-port`), as frameworks start several servers per node. Each flag is
accepted (with its effect), mapped (a GPU flag, to what it means on this machine) or refused with
the reason; an unknown flag is an error naming it. Nothing is silently ignored. The model is a local
HF directory or `smollm2`: there is no model hub here. `--config FILE.yaml` gives flags by their
names (`max-num-seqs: 8`); the command line's own win.

As vLLM's server: its development routes (`DEV_ROUTES`: sleep, weight transfer, pause, collective
RPC, ...) answer 404 unless `VLLM_SERVER_DEV_MODE=1`, and the LoRA load / unload routes unless
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`, both read from the environment; `VLLM_BATCH_INVARIANT=1` is
the engine's `batch_invariant` mode, as vLLM's batch-invariant mode.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Optional

from inference.sampling.params import MAX_LOGPROBS
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

# vLLM flags refused, each with the reason
REFUSED = {
    "--trust-remote-code": "no remote code runs here: the model's architecture must be one the engine implements",
    "--pipeline-parallel-size": "one process serves the whole model, without pipeline stages: leave it out",
    "--data-parallel-size": "start one server per replica (and `rollout route` over them)",
}
SWITCHES = {"--trust-remote-code"}  # the refused flags that take no value

# vLLM's development routes (its `serve/dev_mode` routers) that this front serves: served only with
# VLLM_SERVER_DEV_MODE=1, as vLLM's
DEV_ROUTES = ("/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache", "/collective_rpc", "/server_info",
              "/pause", "/resume", "/is_paused", "/abort_requests", "/init_weight_transfer_engine",
              "/start_weight_update", "/update_weights", "/finish_weight_update", "/update_weight_version",
              "/weight_info", "/get_world_size")
RUNTIME_LORA_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # VLLM_ALLOW_RUNTIME_LORA_UPDATING

LOGPROBS_MODES = {"raw_logprobs": "raw", "processed_logprobs": "processed"}
LOAD_FORMATS = {"auto": "auto", "safetensors": "safetensors", "dummy": "dummy"}
WEIGHT_BACKENDS = {"nccl"}  # vLLM's broadcast from the trainer's rank 0: here torch.distributed (gloo on CPU)

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout vllm-serve", allow_abbrev=False,
                                description="vLLM's `vllm serve` command line, served by this engine "
                                "(rollout.server.vllm_serve)")
    p.add_argument("model", nargs="?", help="a local HF model directory, or `smollm2` (no model hub here)")
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
    from rollout.http.core.tools import TOOL_PARSERS

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
    p.add_argument("--config", metavar="FILE.yaml", help="flags by name from a YAML file (the command line's win)")
    p.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH|JSON",
                   help="adapters loaded at start (needs --enable-lora): name=path or "
                   '\'{"name": ..., "path": ..., "base_model_name": ...}\'')
    p.add_argument("--max-logprobs", type=int, default=20,
                   help=f"the largest top-n log-probs a request may ask (-1: this engine's cap, {MAX_LOGPROBS})")
    p.add_argument("--logprobs-mode", default="raw_logprobs", metavar="MODE",
                   help="raw_logprobs (default) or processed_logprobs, for requests that name none; the logits "
                   "modes are refused (log-probs are returned, not logits)")
    p.add_argument("--chat-template", metavar="FILE|TEMPLATE", help="replaces the tokenizer's chat template")
    p.add_argument("--tokenizer", metavar="DIR", help="a local tokenizer directory (default: the model's)")
    p.add_argument("--load-format", default="auto", metavar="FORMAT",
                   help="auto / safetensors (the checkpoint) or dummy (random weights from config.json)")
    p.add_argument("--weight-transfer-config", metavar="JSON",
                   help='\'{"backend": "nccl"}\' (default): /init_weight_transfer_engine joins the trainer\'s '
                   "torch.distributed group (gloo on CPU, NCCL on GPU); ipc is refused (pickled CUDA handles)")
    p.add_argument("--worker-extension-cls", metavar="CLASS",
                   help="accepted, no code imported: /collective_rpc serves the methods RL frameworks' worker "
                   "extensions define (rollout.http.vllm.vllm_weight_routes)")
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


def serve_args(argv: list[str], free_bytes: Optional[int] = None,
               environ: Optional[dict[str, str]] = None) -> argparse.Namespace:
    """`rollout serve`'s arguments for a `vllm serve` line (its arguments after `serve`); raises
    `LaunchLineError` for a flag it refuses and exits as argparse does (status 2) for an unknown one.
    `environ` (default os.environ): where VLLM_SERVER_DEV_MODE and VLLM_ALLOW_RUNTIME_LORA_UPDATING are read."""
    argv = normalized(argv)
    v = build_parser().parse_args(argv)
    if v.config is not None:  # NOTE: the file's flags first, so the command line's own win
        v = build_parser().parse_args(config_file_args(v.config) + argv)
    if v.model is None:
        raise LaunchLineError("the model is missing: `rollout vllm-serve MODEL ...` (or `model:` in --config)")
    for flag in REFUSED:
        if getattr(v, flag[2:].replace("-", "_")) is not None:
            raise LaunchLineError(f"{flag}: {REFUSED[flag]}")
    check_one("--tensor-parallel-size", v.tensor_parallel_size,
              "start one server per replica; `rollout route` spreads requests over them")
    check_host(v.host, v.api_key, "VLLM_API_KEY")
    check_model(v.model, "")
    if v.tokenizer is not None:
        check_model(v.tokenizer, "--tokenizer ", "tokenizer_config.json", named=False)
    check_weight_transfer(v.weight_transfer_config)
    environ = os.environ if environ is None else environ
    closed = ([] if env_flag(environ, "VLLM_SERVER_DEV_MODE") else list(DEV_ROUTES)) + \
        ([] if runtime_lora(environ) else list(RUNTIME_LORA_ROUTES))
    max_len = v.max_model_len or 4096
    chunk = min(v.max_num_batched_tokens or 2048, max_len) if v.enable_chunked_prefill else max_len
    kv = None if v.gpu_memory_utilization is None else kv_bytes(v.gpu_memory_utilization, "--gpu-memory-utilization",
                                                                free_bytes)
    line = ["--model", v.model, "--host", "127.0.0.1", "--port", str(v.rollout_zmq_port or 0), "--http", str(v.port),
            "--http-host", v.host, "--dtype", DTYPES[v.dtype], "--device", v.device,
            "--max-loras", str(v.max_loras if v.enable_lora else 0), "--max-lora-rank", str(v.max_lora_rank),
            "--tool-call-parser", v.tool_call_parser, "--chunked-prefill-size", str(chunk),
            "--generation-config", v.generation_config, "--max-logprobs", str(max_logprobs(v.max_logprobs)),
            "--logprobs-mode", choice("--logprobs-mode", v.logprobs_mode, LOGPROBS_MODES),
            "--load-format", choice("--load-format", v.load_format, LOAD_FORMATS)]
    return serve_namespace(line, {
        "--served-model-name": v.served_model_name, "--api-key": v.api_key, "--seed": v.seed,
        "--max-seq-len": v.max_model_len, "--max-requests": v.max_num_seqs,
        "--max-batch-tokens": v.max_num_batched_tokens, "--threads": v.threads, "--kv-memory-bytes": kv,
        "--no-prefix-caching": not v.enable_prefix_caching, "--skip-tokenizer-init": v.skip_tokenizer_init,
        "--enable-prompt-tokens-details": v.enable_prompt_tokens_details,
        "--return-tokens-as-token-ids": v.return_tokens_as_token_ids, "--no-zmq": v.rollout_zmq_port is None,
        "--batch-invariant": env_flag(environ, "VLLM_BATCH_INVARIANT"),
        "--chat-template": v.chat_template, "--tokenizer": v.tokenizer,
        "--lora-modules": lora_modules(v.lora_modules, v.enable_lora, v.served_model_name or [Path(v.model).name])},
        repeated={"--close-route": closed})


def config_file_args(path: str) -> list[str]:
    """vLLM's `--config FILE.yaml`: each key a flag's name (`max-num-seqs: 8`, `enable-prefix-caching:
    true`), as the command line would give it; `model:` the positional."""
    import yaml

    try:
        values = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise LaunchLineError(f"--config {path}: {exc}") from None
    if not isinstance(values, dict):
        raise LaunchLineError(f"--config {path}: a YAML mapping of flag names to values, got {type(values).__name__}")
    out: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--model":
            out.insert(0, str(value))
        elif flag == "--config":
            raise LaunchLineError(f"--config {path}: a config file may not name another")
        elif value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + flag[2:])
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        elif value is not None:
            out += [flag, str(value)]
    return out


def env_flag(environ: Any, name: str) -> bool:
    """vLLM's integer switches (VLLM_SERVER_DEV_MODE=1, VLLM_BATCH_INVARIANT=1): on when not 0."""
    value = environ.get(name, "0").strip() or "0"
    try:
        return bool(int(value))
    except ValueError:
        raise LaunchLineError(f"{name}={value!r}: 0 or 1") from None


def runtime_lora(environ: Any) -> bool:
    """vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: on for 1 or true."""
    return environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


def choice(flag: str, value: str, table: dict[str, str]) -> str:
    if value not in table:
        raise LaunchLineError(f"{flag} {value}: one of {', '.join(table)} here")
    return table[value]


def max_logprobs(value: int) -> int:
    if value == -1:  # NOTE: vLLM's "no cap": here the engine's own
        return MAX_LOGPROBS
    if not 0 <= value <= MAX_LOGPROBS:
        raise LaunchLineError(f"--max-logprobs {value}: at most {MAX_LOGPROBS} here (-1: that cap)")
    return value


def check_weight_transfer(value: Optional[str]) -> None:
    if value is None:
        return
    try:
        config = json.loads(value)
    except ValueError:
        raise LaunchLineError(f"--weight-transfer-config {value}: not JSON") from None
    if not isinstance(config, dict) or set(config) - {"backend"}:
        raise LaunchLineError(f"--weight-transfer-config {value}: takes {{\"backend\": ...}} only")
    backend = config.get("backend", "nccl")
    if backend == "ipc":
        raise LaunchLineError("--weight-transfer-config: backend ipc sends pickled CUDA IPC handles, and nothing "
                              "pickled is loaded here; use nccl (or /update_weights_from_tensor)")
    if backend not in WEIGHT_BACKENDS:
        raise LaunchLineError(f"--weight-transfer-config: backend {backend!r}: nccl only here")


def lora_modules(specs: Optional[list[str]], enabled: bool, served: list[str]) -> Optional[list[str]]:
    """vLLM's `--lora-modules` (name=path, or a JSON object with name, path, base_model_name) as
    `rollout serve`'s NAME=PATH."""
    if not specs:
        return None
    if not enabled:
        raise LaunchLineError("--lora-modules: needs --enable-lora (as vLLM's)")
    out = []
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                module = json.loads(spec)
            except ValueError:
                raise LaunchLineError(f"--lora-modules {spec}: not JSON") from None
            if not isinstance(module, dict) or not {"name", "path"} <= set(module) or \
                    set(module) - {"name", "path", "base_model_name"}:
                raise LaunchLineError(f"--lora-modules {spec}: takes name, path and base_model_name")
            base = module.get("base_model_name")
            if base is not None and base not in served:
                raise LaunchLineError(f"--lora-modules {spec}: base_model_name {base!r} is not a served name "
                                      f"({', '.join(served)})")
            spec = f"{module['name']}={module['path']}"
        elif "=" not in spec:
            raise LaunchLineError(f"--lora-modules {spec}: name=path or a JSON object")
        out.append(spec)
    return out


def main(argv: list[str]) -> int:
    return run("vllm-serve", serve_args, argv)

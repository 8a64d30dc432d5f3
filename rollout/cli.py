"""`rollout ...` console entry points.

    rollout grpo                      # the colocated GRPO demo (tiny Llama, counting task)
    rollout grpo --model smollm2      # SmolLM2-135M-Instruct on arithmetic (slow on CPU)
    rollout grpo --steps 50 --no-wandb
    rollout grpo --model smollm2 --lora 16               # a rank-16 LoRA (PEFT), the engine aliasing the adapter
    rollout grpo --disaggregated                         # trainer here, 2 replicas behind a router, gloo sync
    rollout grpo --disaggregated --off-policy 1          # generation of step k+1 overlaps training on k
    rollout serve --model smollm2 --port 5555            # an engine behind ZMQ
    rollout serve --model smollm2 --port 5555 --http 8000   # ... and OpenAI / SGLang routes over HTTP
    rollout http --connect tcp://127.0.0.1:5555 --model smollm2 --port 8000   # HTTP in front of any service
    rollout route --replicas tcp://127.0.0.1:5555,tcp://127.0.0.1:5556   # one endpoint over replicas
    rollout route --spawn 2 --model /ckpt/hf-dir -- --threads 1           # ... that it starts itself
    rollout monitor --connect tcp://127.0.0.1:5555       # its metrics to W&B (offline) and the console
    rollout generate --input prompts.jsonl --output rollouts.jsonl --model smollm2 -n 8   # offline best-of-n
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional

from rollout.rl.colocated import GRPOConfig, ModelKind, format_summary, run_grpo


def _add_grpo_arguments(parser: argparse.ArgumentParser) -> None:
    d = GRPOConfig()
    parser.add_argument("--model", choices=[m.value for m in ModelKind], default=d.model.value,
                        help="tiny: 2-layer Llama from random init on counting; hybrid-tiny: 2-layer Bamba (Mamba2 + "
                             "attention) on counting; smollm2: SmolLM2-135M on arithmetic")
    parser.add_argument("--steps", type=int, help=f"training steps (default {d.steps}; smollm2: 30)")
    parser.add_argument("--prompts", dest="prompts_per_step", type=int, help=f"prompts per step ({d.prompts_per_step})")
    parser.add_argument("-n", "--samples", dest="samples_per_prompt", type=int,
                        help=f"samples per prompt, the GRPO group ({d.samples_per_prompt})")
    parser.add_argument("--lr", type=float, help=f"AdamW learning rate ({d.lr}; smollm2: 5e-6)")
    parser.add_argument("--temperature", type=float, help=f"sampling temperature ({d.temperature}; smollm2: 0.7)")
    parser.add_argument("--clip-eps", type=float, help=f"PPO clip range ({d.clip_eps})")
    parser.add_argument("--entropy-coef", type=float,
                        help=f"entropy bonus of a sample, x its group's reward deficit ({d.entropy_coef}; smollm2: 0)")
    parser.add_argument("--curriculum-pool", type=int, help="draw failing prompts up to this many times as often "
                        f"(1: off; {d.curriculum_pool}; smollm2: 1)")
    parser.add_argument("--lr-final", type=float,
                        help=f"learning rate at the last step, along a cosine from --lr ({d.lr_final}; smollm2: --lr)")
    parser.add_argument("--micro-batch", dest="micro_batch_size", type=int, help="rows per backward (all)")
    parser.add_argument("--seed", type=int, help=f"seed of model init, prompts and sampling ({d.seed})")
    parser.add_argument("--hidden-size", type=int, help=f"tiny model width ({d.hidden_size})")
    parser.add_argument("--layers", dest="num_layers", type=int, help=f"tiny model depth ({d.num_layers})")
    parser.add_argument("--threads", type=int, help="torch threads (tiny: 1; smollm2: one per core)")
    parser.add_argument("--out-dir", help=f"where runs go ({d.out_dir}/<run name>/)")
    parser.add_argument("--run-name", help="run name (default: grpo-<model>-seed<seed>-<time>)")
    parser.add_argument("--table-every", type=int, help=f"print a table row every k steps ({d.table_every})")
    parser.add_argument("--eval-every", type=int,
                        help=f"held-out reward (greedy and sampled) every k steps and at the last ({d.eval_every})")
    parser.add_argument("--no-wandb", dest="wandb", action="store_false", default=None,
                        help="do not log to W&B (default: offline W&B; WANDB_MODE=online logs for real)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                        help="no progress bar")
    parser.add_argument("--speculative", action="store_true", default=None,
                        help="the engine speculates on each batch's tail (draft-free, lossless)")
    parser.add_argument("--batch-invariant", action="store_true", default=None,
                        help="each sample the same bits whatever shares its steps (the engines' batch_invariant)")
    parser.add_argument("--zero-mismatch", action="store_true", default=None,
                        help="the trainer's log-probs by the engine's kernels on its weights, equal to the sampled "
                        "ones bit for bit (implies --batch-invariant; with --disaggregated: on policy, fp32 replicas, "
                        "--api rollout, no --lora)")
    parser.add_argument("--lora", dest="lora_rank", type=int, metavar="R",
                        help="train a LoRA adapter of rank R (PEFT, all attention and MLP projections) instead of "
                             "the full weights; the engine serves it aliased when colocated (lr default: tiny 1e-2, "
                             "smollm2 1e-3)")
    parser.add_argument("--lora-alpha", type=float, help="the adapter's alpha (scaling alpha / R; default 2 x R)")
    dis = parser.add_argument_group("disaggregated (the trainer here, engines in `rollout serve` processes)")
    dis.add_argument("--disaggregated", action="store_true", help="run the engines as replica processes and "
                     "sync the weights into them every step (rollout.rl.disaggregated)")
    dis.add_argument("--replicas", type=int, default=2, help="replica processes to start behind a router (2)")
    dis.add_argument("--router", metavar="ADDRESS", help="a running router (`rollout route`) whose replicas serve "
                     "the same model, instead of starting them")
    dis.add_argument("--off-policy", type=int, choices=[0, 1], default=0,
                     help="1: generate step k+1 while the trainer steps on k (samples one version behind)")
    dis.add_argument("--transport", choices=["gloo", "shm", "disk"], default="gloo",
                     help="how the weights travel (gloo broadcast, shared memory, a safetensors directory)")
    dis.add_argument("--sync-timeout-s", type=float, default=60.0, help="bound of every wait of a weight sync")
    dis.add_argument("--replica-dtype", choices=["float32", "bfloat16"], default="float32",
                     help="what the replicas serve: the fp32 weights, or their bf16 cast")
    dis.add_argument("--delta", action="store_true", help="send each step only what changed since the last sync "
                     "(gloo / shm; bitwise, checked by a hash of the full weights)")
    dis.add_argument("--api", choices=["rollout", "vllm"], default="rollout",
                     help="vllm: reach the replicas by vLLM-family calls only (HTTP, its weight phases over gloo)")


_DISAGGREGATED_ARGS = ("disaggregated", "replicas", "router", "off_policy", "transport", "sync_timeout_s",
                       "replica_dtype", "delta", "api")


def config_from_args(args: argparse.Namespace) -> GRPOConfig:
    skip = ("command", "model", "func", *_DISAGGREGATED_ARGS)
    overrides = {k: v for k, v in vars(args).items() if k not in skip}
    return GRPOConfig.preset(args.model, **overrides)


def grpo_main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if getattr(args, "disaggregated", False):
        from rollout.rl.disaggregated import DisaggregatedConfig, format_disaggregated, run_disaggregated_grpo

        dcfg = DisaggregatedConfig(replicas=args.replicas, router=args.router, off_policy=args.off_policy,
                                   transport=args.transport, sync_timeout_s=args.sync_timeout_s,
                                   replica_dtype=args.replica_dtype, delta=args.delta, api=args.api)
        print(format_disaggregated(run_disaggregated_grpo(cfg, dcfg)), flush=True)
        return 0
    summary = run_grpo(cfg)
    print(format_summary(summary), flush=True)
    return 0


def serve_main(args: argparse.Namespace) -> int:
    from rollout.server.serve import serve_main as run

    return run(args)


def http_main(args: argparse.Namespace) -> int:
    from rollout.server.serve import http_main as run

    return run(args)


def route_main(args: argparse.Namespace) -> int:
    from rollout.router.process import route_main as run

    return run(args)


def monitor_main(args: argparse.Namespace) -> int:
    from rollout.rl.tracking import monitor_service

    return monitor_service(args.connect, every_s=args.every, count=args.count, use_wandb=args.wandb,
                           out_dir=args.out_dir, token=args.token)


def build_parser() -> argparse.ArgumentParser:
    from rollout.router.process import add_route_arguments
    from rollout.server.serve import add_http_arguments, add_serve_arguments

    parser = argparse.ArgumentParser(prog="rollout", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    grpo = sub.add_parser("grpo", help="GRPO: colocated (trainer and engine in one process, sharing weights) or "
                          "--disaggregated (engines in processes of their own, weights synced every step)")
    _add_grpo_arguments(grpo)
    grpo.set_defaults(func=grpo_main)
    serve = sub.add_parser("serve", help="serve one engine over ZMQ (see rollout.server.serve)")
    add_serve_arguments(serve)
    serve.set_defaults(func=serve_main)
    sub.add_parser("vllm-serve", add_help=False, help="serve one engine from a `vllm serve MODEL [flags]` line: "
                   "`rollout vllm-serve MODEL [flags]` (rollout.server.vllm_serve)")
    sub.add_parser("sglang-serve", add_help=False, help="serve one engine from a `python -m sglang.launch_server` "
                   "line: `rollout sglang-serve [flags]` (rollout.server.sglang_serve)")
    http = sub.add_parser("http", help="OpenAI / SGLang HTTP routes in front of a server or router (rollout.http)")
    add_http_arguments(http)
    http.set_defaults(func=http_main)
    route = sub.add_parser("route", help="one endpoint over engine replicas: placement, failover (rollout.router)")
    add_route_arguments(route)
    route.set_defaults(func=route_main)
    from rollout.offline import add_generate_arguments, generate_main

    gen = sub.add_parser("generate", help="prompts from a JSONL file, n samples each, to a JSONL of rollouts, by a "
                         "local engine or a server / router (rollout.offline)")
    add_generate_arguments(gen)
    gen.set_defaults(func=generate_main)
    monitor = sub.add_parser("monitor", help="poll a server's stats into W&B (offline by default) and the console")
    monitor.add_argument("--connect", required=True, help="the server's address, e.g. tcp://127.0.0.1:5555")
    monitor.add_argument("--every", type=float, default=10.0, help="seconds between polls")
    monitor.add_argument("--count", type=int, help="stop after this many polls (default: until interrupted)")
    monitor.add_argument("--token", default=os.environ.get("ROLLOUT_TOKEN"), help="the server's shared secret")
    monitor.add_argument("--out-dir", default="runs/monitor", help="where the W&B run and stats.jsonl go")
    monitor.add_argument("--no-wandb", dest="wandb", action="store_false", help="console only")
    monitor.set_defaults(func=monitor_main)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["vllm-serve"]:  # NOTE: vLLM's own syntax, parsed by its own parser (rollout.server.vllm_serve)
        from rollout.server.vllm_serve import main as vllm_serve

        return vllm_serve(argv[1:])
    if argv[:1] == ["sglang-serve"]:  # NOTE: SGLang's launch_server syntax (rollout.server.sglang_serve)
        from rollout.server.sglang_serve import main as sglang_serve

        return sglang_serve(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

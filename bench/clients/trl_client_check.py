"""TRL's async GRPO client code against `rollout serve --http`: start-up, generation, pause, resume,
and a weight update between them, as its trainer does them.

    python bench/clients/trl_client_check.py --trl-python /tmp/trl-venv/bin/python

Set-up, once: a virtual environment with TRL (`python3.11 -m venv /tmp/trl-venv;
/tmp/trl-venv/bin/pip install torch==2.13.0; /tmp/trl-venv/bin/pip install trl==1.16.0 requests
aiohttp`). TRL's code runs there, unchanged: its `VLLMClient` (`trl/experimental/async_grpo/
vllm_client.py`) for readiness, `max_model_len`, dtype, world size, `/pause?mode=keep`, `/resume`
and the start / finish phases, and its rollout loop's own `_generate_one_turn` (the request its
workers send to `/v1/completions`, its answer read as they read it). Its NCCL weight producer
imports vLLM, so the tensors of the update are broadcast by our vLLM-layout trainer
(`weight_sync.vllm_trainer`) over gloo, between TRL's start and finish calls.

Printed: each step with what TRL's code got, and whether the update showed (the greedy reply of a
prompt changes to the new weights' and the version goes up).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# run by TRL's interpreter: one step per invocation, its result as one JSON line
TRL_STEP = r'''
import asyncio, json, sys
from collections import defaultdict
import aiohttp
from accelerate import PartialState
from trl.experimental.async_grpo.vllm_client import VLLMClient
from trl.experimental.async_grpo import async_rollout_worker as worker

url, step = sys.argv[1], sys.argv[2]
PartialState()  # NOTE: TRL logs through accelerate, which wants its state set up (its trainer does that)
client = VLLMClient(url, server_timeout=60)


async def generate(prompt):
    loop = object.__new__(worker._AsyncRolloutLoop)  # NOTE: only what _generate_one_turn reads
    loop.vllm_server_url, loop.request_timeout, loop.model_name, loop.lora_name = url, 60, "tiny-chat", None
    loop.max_tokens, loop.temperature, loop.top_p, loop.top_k, loop.min_p = 6, 0.0, 1.0, -1, None
    loop.repetition_penalty, loop._counters = 1.0, defaultdict(int)
    async with aiohttp.ClientSession() as loop.session:
        return await loop._generate_one_turn(prompt)


if step == "startup":
    client.wait_for_server_ready(poll_interval_s=0.2)
    out = {"max_model_len": client.get_max_model_len(), "dtype": client.get_dtype(),
           "world_size": client.get_world_size()}
elif step == "generate":
    replies = [asyncio.run(generate(prompt)) for prompt in ([1, 400, 500, 600], [50, 60, 70])]
    out = {"ids": [ids for ids, _ in replies], "logprobs": [lps for _, lps in replies]}
elif step == "pause":
    client.pause()
    out = {"paused": True}
elif step == "start":
    client.start_weight_update()
    out = {"started": True}
elif step == "finish":
    client.finish_weight_update()
    out = {"finished": True}
elif step == "resume":
    client.resume()
    out = {"resumed": True}
print(json.dumps(out))
'''


def trl(python: str, script: Path, url: str, step: str) -> dict:
    run = subprocess.run([python, str(script), url, step], capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        raise RuntimeError(f"TRL step {step} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-python", required=True, help="the interpreter with `trl` installed")
    args = parser.parse_args(argv)
    import httpx
    from safetensors.torch import load_file

    from rollout import ServerProcess
    from tests.rollout.http_util import HTTP_SERVER_ARGS, save_tiny_chat_model
    from weight_sync.vllm_trainer import VllmWeightTrainer

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        script = root / "trl_step.py"
        script.write_text(TRL_STEP)
        old, new = save_tiny_chat_model(root / "old", seed=0), save_tiny_chat_model(root / "new", seed=1)
        with ServerProcess(old, *HTTP_SERVER_ARGS, ready_timeout=60) as server:
            url = server.http_url
            version = lambda: httpx.get(f"{url}/weight_info", timeout=30).json()["weight_version"]  # noqa: E731
            print("startup:", trl(args.trl_python, script, url, "startup"))
            before = trl(args.trl_python, script, url, "generate")
            print("generate (old weights):", before["ids"], f"version {version()}")
            sender = VllmWeightTrainer([url], backend="gloo", timeout_s=20.0)
            try:
                sender.init()
                print("pause:", trl(args.trl_python, script, url, "pause"))
                print("start_weight_update:", trl(args.trl_python, script, url, "start"))
                sent = sender.send(sorted(load_file(new / "model.safetensors").items()), packed=True)
                print(f"update_weights: {sent} bytes broadcast by our vLLM-layout sender")
                print("finish_weight_update:", trl(args.trl_python, script, url, "finish"))
                print("resume:", trl(args.trl_python, script, url, "resume"))
            finally:
                sender.close()
            after = trl(args.trl_python, script, url, "generate")
            print("generate (new weights):", after["ids"], f"version {version()}")
            print("the update showed:", after["ids"] != before["ids"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

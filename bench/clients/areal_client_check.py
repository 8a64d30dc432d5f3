"""AReaL's remote SGLang engine client (`areal==1.0.4`, `areal/engine/sglang_remote.py`, its
`RemoteInfEngine`) driving a real `rollout serve --http`, unchanged: start-up (its health wait),
`agenerate` (its request built and its answer parsed by its `SGLangBackend`), pause / continue,
offload / onload by tags, a disk weight update announced the way its trainer announces one.

    python bench/clients/areal_client_check.py --areal-python /tmp/areal-venv/bin/python

Set-up, once: a Python 3.12 virtual environment with AReaL's client and what its import needs
(`python3.12 -m venv /tmp/areal-venv; pip install torch==2.13.0; pip install --no-deps areal==1.0.4;
pip install numpy pybase64 aiohttp requests torchdata transformers colorlog tenacity flask lark uvloop
hydra-core pillow ray==2.56.0 openai`): AReaL pins older torch and transformers, which its
client code does not use. The model is a tiny random Llama with SmolLM2's tokenizer; what AReaL's
calls answer is compared with an engine in this process on the same weights (greedy).
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

DRIVER = r'''
import asyncio, json, sys, time
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, NameResolveConfig
from areal.api.io_struct import ModelRequest, WeightUpdateMeta
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.utils import name_resolve, names

addr, new_dir, root = sys.argv[1], sys.argv[2], sys.argv[3]
name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=root))
config = InferenceEngineConfig(experiment_name="check", trial_name="t0", setup_timeout=60, request_timeout=60,
                               request_retries=1, pause_grace_period=0.1, max_concurrent_rollouts=4)
engine = RemoteSGLangEngine(config)
out = {}
engine.initialize(addr=[addr], train_data_parallel_size=1)
out["initialized"] = engine.initialized
prompts = json.loads(sys.argv[4])

def generate():
    async def run():
        outs = []
        for p in prompts:
            r = await engine.agenerate(ModelRequest(input_ids=list(p), gconfig=GenerationHyperparameters(
                max_new_tokens=6, greedy=True, ignore_eos=True)))
            outs.append({"tokens": r.output_tokens, "logprobs": r.output_logprobs, "stop": r.stop_reason,
                         "versions": r.output_versions})
        return outs
    return asyncio.run(run())

out["old"] = generate()
engine.pause_generation()
engine.continue_generation()
engine.offload()
engine.onload(tags=["weights"])
engine.onload(tags=["kv_cache"])
out["after_onload"] = generate()
# the trainer's side of a disk update, as AReaL's trainer announces a saved checkpoint
name_resolve.add(names.update_weights_from_disk("check", "t0", engine.get_version()), str(time.time()),
                 replace=True)
meta = WeightUpdateMeta(type="disk", path=new_dir, clear_checkpoint_after_load=False)
engine.update_weights_from_disk(meta).result(timeout=120)
engine.set_version(1)
out["new"] = generate()
engine.destroy()
print("RESULT " + json.dumps(out))
'''


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--areal-python", required=True, help="the interpreter with `areal` installed")
    args = parser.parse_args(argv)

    from tests.rollout.http_util import greedy_ids, http_server_process, old_and_new_models

    prompts = [[1, 400, 500, 600], [50, 60, 70]]
    with tempfile.TemporaryDirectory() as tmp:
        old, new = old_and_new_models(Path(tmp))
        expected = {"old": greedy_ids(old, prompts), "new": greedy_ids(new, prompts)}
        with http_server_process(old) as proc:
            addr = proc.http_url.removeprefix("http://")
            run = subprocess.run([args.areal_python, "-c", DRIVER, addr, str(new), str(Path(tmp) / "names"),
                                  json.dumps(prompts)], capture_output=True, text=True, timeout=600)
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        print(run.stdout[-3000:], run.stderr[-6000:], sep="\n")
        print("FAILED: AReaL's driver did not finish")
        return 1
    out = json.loads(line[len("RESULT "):])
    checks = {
        "start-up (its /health wait)": out["initialized"],
        "agenerate: ids equal an in-process engine (greedy)": [o["tokens"] for o in out["old"]] == expected["old"],
        "agenerate: one log-prob per token, each <= 0": all(
            len(o["logprobs"]) == len(o["tokens"]) and all(lp <= 0 for lp in o["logprobs"]) for o in out["old"]),
        "agenerate: stop reason length (ignore_eos, 6 tokens)": all(o["stop"] == "length" for o in out["old"]),
        "pause, continue, offload, onload weights then kv_cache: same ids after": (
            [o["tokens"] for o in out["after_onload"]] == expected["old"]),
        "update_weights_from_disk: the new weights serve": [o["tokens"] for o in out["new"]] == expected["new"],
    }
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    print(f"{sum(checks.values())}/{len(checks)} passed")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

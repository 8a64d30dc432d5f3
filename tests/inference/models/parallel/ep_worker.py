"""One expert-parallel rank in its own process, driven by a JSON job file; results as msgpack.

`python -m tests.inference.models.parallel.ep_worker JOB.json` (from the repo root). The job names the
model directory, the rank, the group's addresses, the engine config, this rank's requests, and
optionally a checkpoint to update the weights to (then the same requests again) or a round after
which the rank kills itself (SIGKILL: no goodbye to its peers). The results: every request's
tokens and log-probs, the resident expert bytes, the bucket agreed each round, dummy steps; or the
error that stopped the rank.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback

import torch

torch.set_num_threads(1)  # NOTE: ranks share 2 cores; one intra-op thread each


def main(job_path: str) -> int:
    import msgpack

    from inference import InferenceConfig, SamplingParams
    from inference.ep_launch import start_ep_rank
    from inference.models.loading import read_safetensors

    job = json.loads(open(job_path).read())
    result: dict = {"rank": job["rank"], "error": None}
    try:
        engine = start_ep_rank(job["model_dir"], InferenceConfig(**job["config"]), rank=job["rank"],
                               world_size=job["world_size"], dist_init=job["dist_init"],
                               ep_address=job["ep_address"], timeout_s=job["timeout_s"],
                               init_timeout_s=job.get("init_timeout_s", 120.0))
        ep = engine.core.ep
        result["expert_bytes"] = engine.model.expert_bytes()
        die = job.get("die_after_rounds")
        if die is not None:
            comm_sync = ep.comm.sync_all_reduce_max

            def dying_sync(values):
                if ep.comm.round >= die:
                    os.kill(os.getpid(), signal.SIGKILL)
                return comm_sync(values)

            ep.comm.sync_all_reduce_max = dying_sync
        passes = [None] + ([job["update_dir"]] if job.get("update_dir") else [])
        result["passes"] = []
        for update_dir in passes:
            if update_dir is not None:
                engine.update_weights(read_safetensors(update_dir, None))
            ids = {}
            for key, prompt, max_tokens in job["requests"]:
                params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                ids[engine.add_request(prompt, params)] = key
            outputs = engine.step_until_ep_idle()
            result["passes"].append({ids[o.request_id]: [o.generated_token_ids, o.logprobs] for o in outputs})
        result.update(buckets=[list(b) for b in ep.buckets], dummy_steps=ep.dummy_steps, steps=engine.num_steps,
                      rounds=ep.rounds, preemptions=engine.scheduler.num_preemptions)
    except Exception as exc:  # NOTE: reported to the test, which checks the message
        result["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    with open(job["out"], "wb") as f:
        f.write(msgpack.packb(result))
    return 0 if result["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

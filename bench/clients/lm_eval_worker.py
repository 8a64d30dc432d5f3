"""One `lm_eval.simple_evaluate` run, in lm-evaluation-harness's own venv (never the project's): it
imports nothing of this project, so the harness drives our HTTP front exactly as it drives vLLM.

    /tmp/lmeval-venv/bin/python bench/clients/lm_eval_worker.py SPEC.json OUT.json

SPEC: {"model": "hf" | "local-completions" | "local-chat-completions", "model_args": {...},
"tasks": [...], "include_path": DIR, "apply_chat_template": bool, "limit": int | null}.
OUT: {"results": {task: metrics}, "samples": {task: [{"doc_id", "target", "resps", "filtered_resps",
"metrics"}]}, "seconds": float}, every response as lm-eval logged it (`log_samples=True`).
"""

from __future__ import annotations

import json
import sys
import time


def run(spec: dict) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model=spec["model"], model_args=spec["model_args"], tasks=spec["tasks"],
        task_manager=TaskManager(include_path=spec["include_path"]), log_samples=True,
        apply_chat_template=spec.get("apply_chat_template", False), limit=spec.get("limit"),
        batch_size=spec.get("batch_size", 1), device="cpu", random_seed=0, numpy_random_seed=0,
        torch_random_seed=0, fewshot_random_seed=0, bootstrap_iters=0)
    samples = {task: [{"doc_id": s["doc_id"], "target": s["target"], "resps": s["resps"],
                       "filtered_resps": s["filtered_resps"],
                       "metrics": {m: s[m] for m in s.get("metrics", []) if m in s}}
                      for s in rows]
               for task, rows in out["samples"].items()}
    return {"results": out["results"], "samples": samples, "seconds": time.perf_counter() - t0}


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec_path", metavar="SPEC.json", help="what to evaluate (this module's docstring)")
    parser.add_argument("out_path", metavar="OUT.json", help="where the results and every logged sample go")
    args = parser.parse_args(argv)
    spec_path, out_path = args.spec_path, args.out_path
    with open(spec_path) as f:
        spec = json.load(f)
    result = run(spec)
    with open(out_path, "w") as f:
        json.dump(result, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""lm-evaluation-harness against `rollout serve --model smollm2 --http`, and against its own `hf` backend
on the same SmolLM2 directory: per-task accuracy of both, the largest per-item log-likelihood gap,
and the items whose chosen answer differs.

    /tmp/lmeval-venv: see LMEVAL_VENV_COMMAND (torch==2.13.0 CPU first, then lm_eval[api], transformers)
    .venv/bin/python bench/clients/lm_eval_harness.py [--mc-items 100] [--gen-items 40]

Two tasks, written here from a seeded RNG (no dataset hub), as lm-eval custom task YAMLs over local
JSONL files (`dataset_path: json`):
- `rollout_arith_mc`: "What is a + b?" with four numeric choices, scored by log-likelihood; the
  served side is `local-completions` with SmolLM2's tokenizer and token-id prompts (`echo` +
  `logprobs`, what vLLM answers).
- `rollout_arith_gen`: the same question in a chat turn, greedy generation until a newline, scored on
  the last number in the reply;
  `local-chat-completions` against `hf` with `apply_chat_template`.

lm_eval runs in its own venv (bench/clients/lm_eval_worker.py), never imported by this project.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

LMEVAL_PYTHON = Path(os.environ.get("LMEVAL_PYTHON", "/tmp/lmeval-venv/bin/python"))
LMEVAL_VENV_COMMAND = (
    f"{Path(sys.base_prefix) / 'bin' / 'python3'} -m venv /tmp/lmeval-venv && "
    "/tmp/lmeval-venv/bin/pip install 'torch==2.13.0' && "
    "/tmp/lmeval-venv/bin/pip install 'lm_eval[api]==0.4.13' 'transformers==5.24.0'")
WORKER = Path(__file__).resolve().with_name("lm_eval_worker.py")
MC_TASK, GEN_TASK = "rollout_arith_mc", "rollout_arith_gen"
SERVED_NAME = "smollm2"

MC_YAML = """task: rollout_arith_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is {{{{a}}}} + {{{{b}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""

GEN_YAML = """task: rollout_arith_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "What is {{{{a}}}} + {{{{b}}}}? Answer with the number only."
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 10
  do_sample: false
  temperature: 0
filter_list:
  - name: number
    filter:
      - function: regex
        regex_pattern: "(\\\\d+)"
        group_select: -1
      - function: take_first
metric_list:
  - metric: exact_match
"""


def write_tasks(directory: Path, mc_items: int, gen_items: int, seed: int = 0) -> Path:
    """The two tasks' JSONL and YAML files under `directory`, the same for the same arguments."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    mc = []
    for _ in range(mc_items):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        wrong = rng.sample([n for n in range(2, 19) if n != a + b], 3)
        label = rng.randrange(4)
        choices = wrong[:label] + [a + b] + wrong[label:]
        mc.append({"a": a, "b": b, "choices": [str(c) for c in choices], "label": label})
    gen = []
    for _ in range(gen_items):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        gen.append({"a": a, "b": b, "answer": str(a + b)})
    for name, rows, yaml in (("arith_mc", mc, MC_YAML), ("arith_gen", gen, GEN_YAML)):
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (directory / f"{name}.yaml").write_text(yaml.format(data=data))
    return directory


def lm_eval(spec: dict, workdir: Path, tag: str, timeout_s: float = 1800.0) -> dict:
    """One worker run in lm-eval's venv; its OUT json (see bench/clients/lm_eval_worker.py)."""
    spec_path, out_path = workdir / f"{tag}.spec.json", workdir / f"{tag}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH="")
    done = subprocess.run([str(LMEVAL_PYTHON), str(WORKER), str(spec_path), str(out_path)], env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval ({tag}) exited with {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(out_path.read_text())


@dataclass(slots=True)
class Comparison:
    """Served vs hf: the MC task's per-choice log-likelihoods (with SmolLM2's tokenizer here, and with
    lm-eval's `remote` tokenizer, our /tokenize routes) and the generation task's replies."""

    mc_acc_served: float
    mc_acc_hf: float
    max_abs_dll: float
    choices_differing: int
    mc_items: int
    mc_acc_remote: float
    max_abs_dll_remote: float
    choices_differing_remote: int
    gen_acc_served: float
    gen_acc_hf: float
    gen_texts_differing: int
    gen_items: int


def _by_doc(rows: list[dict]) -> dict[int, dict]:
    return {r["doc_id"]: r for r in rows}


def mc_gap(served: dict, hf: dict) -> tuple[float, int, int]:
    """(max |served - hf| log-likelihood over every choice, items whose argmax differs, items)."""
    s_rows, h_rows = _by_doc(served["samples"][MC_TASK]), _by_doc(hf["samples"][MC_TASK])
    assert s_rows.keys() == h_rows.keys(), "the two backends scored different items"
    max_dll, differing = 0.0, 0
    for doc, s in s_rows.items():
        s_ll = [float(r[0][0]) for r in s["resps"]]
        h_ll = [float(r[0][0]) for r in h_rows[doc]["resps"]]
        max_dll = max(max_dll, max(abs(x - y) for x, y in zip(s_ll, h_ll, strict=True)))
        differing += max(range(len(s_ll)), key=s_ll.__getitem__) != max(range(len(h_ll)), key=h_ll.__getitem__)
    return max_dll, differing, len(s_rows)


def compare(served_mc: dict, remote_mc: dict, hf_mc: dict, served_gen: dict, hf_gen: dict) -> Comparison:
    max_dll, differing, items = mc_gap(served_mc, hf_mc)
    max_dll_remote, differing_remote, _ = mc_gap(remote_mc, hf_mc)
    gs, gh = _by_doc(served_gen["samples"][GEN_TASK]), _by_doc(hf_gen["samples"][GEN_TASK])
    gen_diff = sum(gs[d]["resps"] != gh[d]["resps"] for d in gs)
    acc = "acc,none"
    return Comparison(
        mc_acc_served=served_mc["results"][MC_TASK][acc], mc_acc_hf=hf_mc["results"][MC_TASK][acc],
        max_abs_dll=max_dll, choices_differing=differing, mc_items=items,
        mc_acc_remote=remote_mc["results"][MC_TASK][acc], max_abs_dll_remote=max_dll_remote,
        choices_differing_remote=differing_remote,
        gen_acc_served=served_gen["results"][GEN_TASK]["exact_match,number"],
        gen_acc_hf=hf_gen["results"][GEN_TASK]["exact_match,number"], gen_texts_differing=gen_diff,
        gen_items=len(gs))


def run(mc_items: int = 100, gen_items: int = 40, workdir: Path | None = None) -> tuple[Comparison, dict]:
    """Both tasks through both backends; the comparison and each run's seconds."""
    import torch

    from inference.models.smollm2 import smollm2_dir
    from rollout import ServerProcess

    model_dir = str(smollm2_dir(torch.float32))
    workdir = Path(workdir or tempfile.mkdtemp(prefix="lm-eval-"))
    tasks = write_tasks(workdir / "tasks", mc_items, gen_items)
    common = {"include_path": str(tasks), "limit": None}
    hf_args = {"pretrained": model_dir, "dtype": "float32"}
    hf_mc = lm_eval({**common, "model": "hf", "model_args": hf_args, "tasks": [MC_TASK], "batch_size": 16},
                    workdir, "hf_mc")
    hf_gen = lm_eval({**common, "model": "hf", "model_args": hf_args, "tasks": [GEN_TASK], "batch_size": 8,
                      "apply_chat_template": True}, workdir, "hf_gen")
    serve_args = ("--dtype", "float32", "--http", "0", "--served-model-name", SERVED_NAME, "--max-seq-len", "2048")
    with ServerProcess("smollm2", *serve_args, ready_timeout=300) as server:
        base = server.http_url
        served_mc = lm_eval({**common, "model": "local-completions", "tasks": [MC_TASK], "batch_size": 16,
                             "model_args": {"base_url": f"{base}/v1/completions", "model": SERVED_NAME,
                                            "tokenizer": model_dir, "tokenizer_backend": "huggingface",
                                            "tokenized_requests": True, "max_retries": 1}}, workdir, "served_mc")
        # no tokenizer: lm-eval finds our /tokenizer_info and /tokenize and tokenizes through them
        remote_mc = lm_eval({**common, "model": "local-completions", "tasks": [MC_TASK], "batch_size": 16,
                             "model_args": {"base_url": f"{base}/v1/completions", "model": SERVED_NAME,
                                            "tokenized_requests": True, "max_retries": 1}}, workdir, "remote_mc")
        served_gen = lm_eval({**common, "model": "local-chat-completions", "tasks": [GEN_TASK],
                              "apply_chat_template": True, "model_args": {
                                  "base_url": f"{base}/v1/chat/completions", "model": SERVED_NAME,
                                  "num_concurrent": 4, "max_retries": 1}}, workdir, "served_gen")
    runs = {"hf_mc": hf_mc, "hf_gen": hf_gen, "served_mc": served_mc, "remote_mc": remote_mc,
            "served_gen": served_gen}
    return compare(served_mc, remote_mc, hf_mc, served_gen, hf_gen), {k: v["seconds"] for k, v in runs.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mc-items", type=int, default=100)
    parser.add_argument("--gen-items", type=int, default=40)
    args = parser.parse_args()
    if not LMEVAL_PYTHON.exists():
        print(f"no lm-eval venv at {LMEVAL_PYTHON}; create it with:\n    {LMEVAL_VENV_COMMAND}")
        return 2
    t0 = time.perf_counter()
    c, seconds = run(args.mc_items, args.gen_items)
    print(f"{'task':<20}{'served':>10}{'hf':>10}   items")
    print(f"{MC_TASK:<20}{c.mc_acc_served:>10.3f}{c.mc_acc_hf:>10.3f}   {c.mc_items} (4 choices, chance 0.25)")
    print(f"{'  remote tokenizer':<20}{c.mc_acc_remote:>10.3f}{c.mc_acc_hf:>10.3f}   lm-eval tokenizing through "
          f"/tokenize: max |dll| {c.max_abs_dll_remote:.2e}, {c.choices_differing_remote} choices differ")
    print(f"{GEN_TASK:<20}{c.gen_acc_served:>10.3f}{c.gen_acc_hf:>10.3f}   {c.gen_items} (exact match)")
    print(f"max |served - hf| log-likelihood over {4 * c.mc_items} choices: {c.max_abs_dll:.2e}")
    print(f"items whose chosen answer differs: {c.choices_differing}; generations differing: "
          f"{c.gen_texts_differing}/{c.gen_items}")
    print("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()) +
          f"; total {time.perf_counter() - t0:.1f}")
    print("RESULT " + json.dumps({"comparison": {k: getattr(c, k) for k in c.__slots__}, "seconds": seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

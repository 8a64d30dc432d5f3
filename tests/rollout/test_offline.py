"""`rollout generate` (rollout.offline) over a 1,000-prompt JSONL of ids, text and chat prompts with
bad lines among them: against a local engine and through a router to two replicas, every good
prompt answered once and equal to one in-process `generate()` of all of them; each bad line
reported by number and skipped."""

from __future__ import annotations

import io
import json
import random

import pytest

from inference import InferenceConfig, SamplingParams
from rollout import RolloutEngine
from rollout.cli import main
from rollout.offline import OfflineGeneration, generate_file, read_prompts
from tests.rollout.http_util import MAX_LEN, WAIT_S, save_tiny_chat_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CONFIG = InferenceConfig(block_size=4, num_blocks=4096, max_requests=128, max_batch_tokens=1024,
                         max_sequence_length=MAX_LEN)
SAMPLING = SamplingParams(temperature=1.0, max_tokens=2, seed=7, ignore_eos=True)
REPLICA_ARGS = ("--threads", "1", "--block-size", "4", "--num-blocks", "4096", "--max-requests", "128",
                "--max-batch-tokens", "1024", "--max-seq-len", str(MAX_LEN))
# (line number, text, why it is refused); the engine's refusal (an id past the vocabulary) is found late
BAD = {
    17: ("{not json", "not JSON"),
    120: ('{"prompt_ids": [1, 2], "prompt": "two"}', "exactly one of"),
    333: ('{"prompt_ids": [4, -1]}', "prompt_ids must be"),
    500: ('{"prompt_ids": [5, 999999]}', "refused"),
    777: ('[1, 2, 3]', "not a JSON object"),
    901: ('{"messages": []}', "messages must be"),
}
BLANK = 640


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-offline"))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    """1,000 lines: ids mostly, every 10th a text, every 25th a chat; the bad lines and a blank one."""
    rng = random.Random(0)
    lines = []
    for number in range(1, 1001):
        if number in BAD:
            lines.append(BAD[number][0])
        elif number == BLANK:
            lines.append("")
        elif number % 25 == 0:
            chat = [{"role": "user", "content": f"Add {number}"}]
            lines.append(json.dumps({"id": f"chat-{number}", "messages": chat}))
        elif number % 10 == 0:
            lines.append(json.dumps({"prompt": f"Count to {number}:"}))
        else:
            lines.append(json.dumps({"prompt_ids": [rng.randrange(3, 49152) for _ in range(rng.randrange(2, 12))]}))
    path = tmp_path_factory.mktemp("offline") / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def reference(model_dir, prompts_file):
    """One in-process `generate()` of every parsed prompt, the refused one standing in as [1] so
    each prompt keeps its index (prompt k is seeded seed + k)."""
    parsed, _ = read_prompts(iter(prompts_file.read_text().splitlines()))
    engine = RolloutEngine(model_dir, CONFIG)
    try:
        prompts = [[1] if p.line == 500 else p.prompt for p in parsed]
        batch = engine.generate(prompts, 2, SAMPLING, timeout=600)
    finally:
        engine.close()
    want = {}
    for r in batch:
        want.setdefault(parsed[r.group].line, {})[r.sample_index] = r.completion_ids
    del want[500]
    return want


def check(out_path, report: str, want) -> None:
    records = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert [r["line"] for r in records] == sorted(want)  # each good prompt once, in input order
    for r in records:
        assert {s["index"]: s["completion_ids"] for s in r["samples"]} == want[r["line"]], r["line"]
        assert all(len(s["logprobs"]) == len(s["versions"]) == SAMPLING.max_tokens and "text" in s
                   for s in r["samples"])
    by_id = {r["line"]: r["id"] for r in records}
    assert by_id[25] == "chat-25" and by_id[1] == 1
    for number, (_, why) in BAD.items():
        assert f"line {number}: " in report and why in report.split(f"line {number}: ")[1].split("\n")[0]
    assert f"line {BLANK}:" not in report


def test_against_a_local_engine_in_chunks(model_dir, prompts_file, reference, tmp_path):
    report = io.StringIO()
    engine = RolloutEngine(model_dir, CONFIG)
    try:
        summary = generate_file(engine, prompts_file, tmp_path / "out.jsonl", 2, SAMPLING, chunk=128,
                                progress=False, report=report)
    finally:
        engine.close()
    assert summary.prompts == 993 and summary.samples == 1986 and len(summary.bad) == len(BAD)
    check(tmp_path / "out.jsonl", report.getvalue(), reference)


def test_through_a_router_by_the_command(model_dir, prompts_file, reference, tmp_path, capsys):
    from rollout.router.process import RouterProcess

    router = RouterProcess("--spawn", "2", "--model", str(model_dir), "--", *REPLICA_ARGS, ready_timeout=2 * WAIT_S)
    try:
        code = main(["generate", "--input", str(prompts_file), "--output", str(tmp_path / "out.jsonl"),
                     "--connect", router.address, "--tokenizer", str(model_dir), "-n", "2",
                     "--max-tokens", str(SAMPLING.max_tokens),
                     "--temperature", "1.0", "--seed", "7", "--chunk", "300", "--no-progress", "--timeout", "300"])
    finally:
        router.stop(grace_s=10.0)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "993 prompts answered" in captured.out and f"{len(BAD)} lines skipped" in captured.out
    check(tmp_path / "out.jsonl", captured.err, reference)


def test_generation_arguments_are_checked():
    with pytest.raises(ValueError, match="n >= 1"):
        OfflineGeneration(None, 0, SAMPLING)

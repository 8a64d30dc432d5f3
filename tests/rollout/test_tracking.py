"""Console table, JSON lines and the PNG, without W&B."""

from __future__ import annotations

import json

from rollout.colocated import summarize
from rollout.tracking import StepTimer, Tracker


def test_tracker_writes_rows_and_plot(tmp_path, capsys):
    tracker = Tracker(tmp_path / "run", total_steps=3, use_wandb=False, show_progress=False, table_every=2)
    for step in range(3):
        timer = StepTimer()
        with timer("train"):
            pass
        tracker.log(step, {"reward": 0.1 * step, "mismatch/mean": 1e-7, "mismatch/max": 1e-6, **timer.metrics(),
                           "policy_version": step, "completion_tokens": 10}, example="1 -> 23.")
    paths = tracker.finish()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == Tracker.header() and len(out) == 3  # header, step 0, step 2 (the last)
    assert out[1].split()[0] == "0" and out[-1].endswith("1 -> 23.")
    rows = [json.loads(line) for line in paths.metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[2]["reward"] == 0.2
    assert paths.plot is not None and paths.plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_format_row_handles_missing_values():
    row = Tracker.format_row({"step": 5, "reward": 0.5, "time/suspend": 0.002})
    assert row.split()[:3] == ["5", "0.500", "-"] and "2.00" in row


def test_summary_finds_the_first_step_at_target():
    history = [{"reward": r, "mismatch/mean": 1e-7, "mismatch/max": 2e-6, "completion_tokens": 1}
               for r in [0.0] * 5 + [1.0] * 20]
    s = summarize(history, 1.0, stale=0, seconds=1.0)
    assert s.first_step_at_target == 13  # the 10-step mean first reaches 0.9 there
    assert s.initial_reward == 0.0 and s.final_reward == 1.0 and s.mismatch_max == 2e-6

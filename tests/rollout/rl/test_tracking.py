"""Console table, JSON lines and the PNG, without W&B."""

from __future__ import annotations

import io
import json
import re

import pytest

from rollout.rl.colocated import summarize
from rollout.rl.tracking import StepTimer, Tracker, plot_history


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


class Terminal(io.StringIO):
    """A console that says it is a terminal, 100 columns wide."""

    def isatty(self):
        return True


def rendered_lines(text: str) -> list[str]:
    """What a terminal shows: each line after its carriage returns overwrote it from column 0."""
    lines = []
    for line in text.split("\n"):
        shown = ""
        for part in line.split("\r"):
            shown = part + shown[len(part):]
        lines.append(shown.rstrip())
    return [line for line in lines if line]


def log_steps(tracker, steps=6):
    rows = []
    for step in range(steps):
        row = {"reward": 0.1 * step, "mismatch/max": 1e-6}
        tracker.log(step, row, example=f"ex{step}")
        if step % tracker.table_every == 0 or step == steps - 1:
            rows.append(Tracker.format_row({"step": step, **row}) + f"  ex{step}")
    tracker.finish()
    return rows


def check_rows_on_their_own_lines(tmp_path):
    console = Terminal()
    tracker = Tracker(tmp_path / "run", total_steps=6, use_wandb=False, table_every=2, stream=console)
    rows = log_steps(tracker)
    shown = rendered_lines(console.getvalue())
    assert "\r" in console.getvalue()  # the bar was drawn
    bars = [line for line in shown if line.startswith("grpo:")]
    assert all(re.fullmatch(r"grpo: +\d+%\|.*\]", line) for line in bars), f"a line is glued to the bar: {bars}"
    assert [line for line in shown if not line.startswith("grpo:")] == [Tracker.header(), *rows]


def test_table_rows_are_written_through_the_bar(tmp_path, no_plot):
    check_rows_on_their_own_lines(tmp_path)


def test_no_bar_off_a_terminal(tmp_path, no_plot):
    console = io.StringIO()
    tracker = Tracker(tmp_path / "run", total_steps=6, use_wandb=False, table_every=2, stream=console)
    rows = log_steps(tracker)
    assert console.getvalue().splitlines() == [Tracker.header(), *rows]  # rows only: a clean log file


@pytest.fixture
def planted_rows_printed_past_the_bar(monkeypatch):
    """Planted bug: table rows printed straight to the console, across the bar."""
    monkeypatch.setattr(Tracker, "_write", lambda self, line: print(line, file=self.stream, flush=True))


def test_the_console_check_catches_rows_glued_to_the_bar(tmp_path, no_plot, planted_rows_printed_past_the_bar):
    with pytest.raises(AssertionError, match="glued"):
        check_rows_on_their_own_lines(tmp_path)


def test_plot_draws_the_held_out_curves(tmp_path, monkeypatch):
    import matplotlib.axes

    labels = []
    plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, *a, **k: labels.append(k.get("label")) or plot(self, *a, **k))
    history = [{"step": s, "reward": 0.1, "mismatch/max": 1e-6, "mismatch/mean": 1e-7,
                **({"heldout/greedy": 0.5, "heldout/sampled": 0.4} if s % 5 == 0 else {})} for s in range(11)]
    assert plot_history(history, tmp_path / "p.png") is not None
    assert {"training reward", "held-out, greedy", "held-out, sampled"} <= set(labels)

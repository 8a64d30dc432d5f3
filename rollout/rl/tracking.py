"""Run tracking for RL loops: W&B (offline by default), a progress bar, a console table, a PNG.

`Tracker.log(step, metrics)` is the one call per step; it appends to `history`, writes a JSON line,
logs to W&B, advances the bar and, every `table_every` steps, prints a table row. `finish()`
writes the PNG of reward and train-inference mismatch against step and closes the W&B run.

Console: the bar and the table share one stream (stdout by default) and every table row, like
every log record meanwhile, is written through the bar (cleared, row, redrawn), so no row is
glued to it. A stream that is not a terminal (a log file, a pipe) gets no bar: the rows are the
progress there, with nothing but rows on their lines.

`ServiceLogger` does the same for a rollout server's `stats()` (tokens/s, queue depth, KV use,
prefix hit rate, pauses, evictions, tokens per version): one console line and one W&B row per
poll; `monitor_service` (`rollout monitor`) polls a server with it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

logger = logging.getLogger(__name__)

# (metric key, column header, width, format): the console table, left to right
COLUMNS: tuple[tuple[str, str, int, str], ...] = (
    ("step", "step", 5, "d"),
    ("reward", "reward", 6, ".3f"),
    ("heldout/greedy", "ho grd", 6, ".3f"),
    ("heldout/sampled", "ho smp", 6, ".3f"),
    ("response_length", "len", 5, ".2f"),
    ("tokens_per_s", "tok/s", 7, ".0f"),
    ("time/generate", "gen s", 6, ".3f"),
    ("time/train", "train s", 7, ".3f"),
    ("time/suspend", "susp ms", 7, ".2f"),
    ("time/resume", "res ms", 6, ".2f"),
    ("time/weight_update", "upd ms", 6, ".2f"),
    ("kv_utilization", "kv %", 5, ".0%"),
    ("prefix_hit_rate", "hit %", 5, ".0%"),
    ("mismatch/mean", "|dlp| mean", 10, ".1e"),
    ("mismatch/max", "|dlp| max", 9, ".1e"),
    ("policy_version", "ver", 4, "d"),
)
MISMATCH_TARGET = 1e-5  # max |engine - trainer| log-prob aimed for in fp32 (float rounding)
_MS_KEYS = {"time/suspend", "time/resume", "time/weight_update"}


class StepTimer:
    """Wall-clock seconds per named phase of one step: `with timer("train"): ...`."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"time/{k}": v for k, v in self.seconds.items()}


@dataclass(slots=True)
class RunPaths:
    out_dir: Path
    metrics: Path
    plot: Optional[Path] = None
    wandb_dir: Optional[Path] = None
    wandb_url: Optional[str] = None


@dataclass
class Tracker:
    """Collects per-step metrics; see the module docstring. Invariant: one `log` per step, in order."""

    out_dir: Path
    total_steps: int
    config: dict[str, Any] = field(default_factory=dict)
    project: str = "rollout-engine"
    run_name: Optional[str] = None
    use_wandb: bool = True
    table_every: int = 10
    max_reward: float = 1.0
    show_progress: bool = True
    stream: Optional[TextIO] = None  # the console: None = sys.stdout at construction
    history: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.paths = RunPaths(self.out_dir, self.out_dir / "metrics.jsonl")
        self._metrics_file = self.paths.metrics.open("w")
        self._wandb = self._init_wandb() if self.use_wandb else None
        if self.stream is None:
            self.stream = sys.stdout
        self._bar = None
        self._console = ExitStack()
        if self.show_progress and _is_terminal(self.stream):
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=self.total_steps, desc="grpo", unit="step", dynamic_ncols=True, file=self.stream)
            # NOTE: log records (e.g. a W&B warning) go through the bar too, not across it
            self._console.enter_context(logging_redirect_tqdm(tqdm_class=type(self._bar)))
        self._header_printed = False

    def _init_wandb(self) -> Any:
        run = init_wandb(self.project, self.run_name, self.config, self.out_dir)
        if run is not None:
            self.paths.wandb_dir = Path(run.dir).parent if run.dir else None
            self.paths.wandb_url = getattr(run, "url", None) or None
        return run

    # ---- per step ----------------------------------------------------------------------------

    def log(self, step: int, metrics: dict[str, Any], example: str = "") -> None:
        row = {"step": step, **metrics}
        self.history.append(row)
        self._metrics_file.write(json.dumps(row, default=float) + "\n")
        self._metrics_file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
        if self._bar is not None:
            self._bar.set_postfix(reward=f"{metrics.get('reward', float('nan')):.3f}",
                                  mismatch=f"{metrics.get('mismatch/max', float('nan')):.1e}", refresh=False)
            self._bar.update(1)
        last = step == self.total_steps - 1
        if step % self.table_every == 0 or last:
            if not self._header_printed:
                self._write(self.header())
                self._header_printed = True
            self._write(self.format_row(row) + (f"  {example}" if example else ""))

    def _write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)  # clears the bar, writes the line, redraws the bar
        else:
            print(line, file=self.stream, flush=True)

    @staticmethod
    def header() -> str:
        return " ".join(f"{title:>{width}}" for _, title, width, _ in COLUMNS) + "  example"

    @staticmethod
    def format_row(row: dict[str, Any]) -> str:
        cells = []
        for key, _, width, fmt in COLUMNS:
            value = row.get(key)
            if value is None or (isinstance(value, float) and math.isnan(value)):
                cells.append(f"{'-':>{width}}")
                continue
            if key in _MS_KEYS:
                value = value * 1e3
            cells.append(f"{value:>{width}{fmt}}")
        return " ".join(cells)

    # ---- the end -----------------------------------------------------------------------------

    def finish(self, summary: Optional[dict[str, Any]] = None) -> RunPaths:
        if self._bar is not None:
            self._bar.close()
        self._console.close()
        self._metrics_file.close()
        self.paths.plot = plot_history(self.history, self.out_dir / "reward_mismatch.png", self.max_reward)
        if self._wandb is not None:
            if summary:
                self._wandb.summary.update(summary)
            if self.paths.plot is not None:
                try:
                    import wandb

                    self._wandb.log({"reward_mismatch": wandb.Image(str(self.paths.plot))})
                except Exception as exc:  # a missing PIL must not lose the run
                    logger.warning("W&B: could not attach the plot (%s)", exc)
            self._wandb.finish()
        return self.paths


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def init_wandb(project: str, name: Optional[str], config: dict[str, Any], out_dir: Path) -> Any:
    """A W&B run (offline unless WANDB_MODE says otherwise), or None if wandb cannot start."""
    os.environ.setdefault("WANDB_MODE", "offline")  # NOTE: online only when the caller asks for it
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        import wandb

        return wandb.init(project=project, name=name, config=config, dir=str(out_dir), reinit="finish_previous")
    except Exception as exc:  # NOTE: tracking must never stop training; say so and go on
        logger.warning("W&B disabled: wandb.init failed (%s: %s)", type(exc).__name__, exc)
        return None


# (stats key, column header, width, format): the console line of `ServiceLogger`
SERVICE_COLUMNS: tuple[tuple[str, str, int, str], ...] = (
    ("tokens_per_s", "tok/s", 8, ".0f"),
    ("queue_depth", "queue", 6, "d"),
    ("requests_in_flight", "flight", 6, "d"),
    ("kv_utilization", "kv %", 5, ".0%"),
    ("prefix_hit_rate", "hit %", 5, ".0%"),
    ("pauses", "pauses", 6, "d"),
    ("evictions", "evict", 6, "d"),
    ("policy_version", "ver", 4, "d"),
)


class ServiceLogger:
    """A rollout server's stats, one poll at a time, to W&B (offline by default), a JSON-lines file
    and the console. Tokens per version go to W&B as `service/tokens_v<k>`."""

    def __init__(self, out_dir: Path, *, use_wandb: bool = True, run_name: Optional[str] = None,
                 project: str = "rollout-engine", config: Optional[dict[str, Any]] = None, echo: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.echo = echo
        self.history: list[dict[str, Any]] = []
        self._file = (self.out_dir / "stats.jsonl").open("a")
        self._wandb = init_wandb(project, run_name, config or {}, self.out_dir) if use_wandb else None
        self._lines = 0

    def log(self, stats: dict[str, Any], step: Optional[int] = None) -> str:
        """Record one poll; returns (and prints, if `echo`) its console line."""
        step = len(self.history) if step is None else step
        self.history.append({"step": step, **stats})
        self._file.write(json.dumps({"step": step, **stats}, default=str) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({f"service/{k}": v for k, v in stats.items() if isinstance(v, (int, float))}, step=step)
        line = self.format_line(stats)
        if self.echo:
            if self._lines % 20 == 0:
                print(self.header(), flush=True)
            print(line, flush=True)
        self._lines += 1
        return line

    @staticmethod
    def header() -> str:
        return " ".join(f"{title:>{width}}" for _, title, width, _ in SERVICE_COLUMNS) + "  tokens per version"

    @staticmethod
    def format_line(stats: dict[str, Any]) -> str:
        cells = []
        for key, _, width, fmt in SERVICE_COLUMNS:
            value = stats.get(key)
            cells.append(f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}")
        versions = {k[len("tokens_v"):]: v for k, v in stats.items() if k.startswith("tokens_v")}
        return " ".join(cells) + "  " + (" ".join(f"v{k}:{v}" for k, v in versions.items()) or "-")

    def finish(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def monitor_service(address: str, *, every_s: float = 10.0, count: Optional[int] = None, use_wandb: bool = True,
                    out_dir: str = "runs/monitor", token: Optional[str] = None) -> int:
    """Poll a server's `stats()` every `every_s` seconds into a `ServiceLogger` (`rollout monitor`)."""
    from rollout.client.sync import RolloutClient
    from rollout.wire.security import ClientSecurity

    security = ClientSecurity(token=token) if token else None
    log = ServiceLogger(Path(out_dir), use_wandb=use_wandb, config={"address": address})
    polls = 0
    try:
        with RolloutClient(address, timeout=max(5.0, every_s), security=security) as client:
            while count is None or polls < count:
                if polls:
                    time.sleep(every_s)
                log.log(client.stats())
                polls += 1
    except KeyboardInterrupt:
        pass
    finally:
        log.finish()
    return 0


def plot_history(history: Sequence[dict[str, Any]], path: Path, max_reward: float = 1.0) -> Optional[Path]:
    """Reward (top: training batches, and held-out prompts greedy and sampled where evaluated) and
    |engine - trainer| log-prob mismatch (bottom, log scale) against step.

    A step where engine and trainer agree exactly (mismatch 0) leaves a gap on the log scale.
    """
    if not history:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")  # NOTE: headless: never open a window, whatever the environment says
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot written (pip install matplotlib)")
        return None
    steps = [h["step"] for h in history]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, constrained_layout=True)
    top.plot(steps, [h.get("reward", math.nan) for h in history], label="training reward", color="tab:blue")
    for key, label, color in (("heldout/greedy", "held-out, greedy", "tab:purple"),
                              ("heldout/sampled", "held-out, sampled", "tab:cyan")):
        points = [(h["step"], h[key]) for h in history if key in h]
        if points:
            top.plot(*zip(*points), label=label, color=color, marker="o", ms=3, lw=1.2)
    top.axhline(max_reward, color="grey", lw=0.8, ls=":", label="max reward")
    top.axhline(0.9 * max_reward, color="tab:green", lw=0.8, ls="--", label="0.9 x max")
    top.set_ylabel("reward")
    top.set_ylim(bottom=0)
    top.legend(loc="lower right")
    top.set_title("colocated GRPO: reward and train-inference mismatch")
    curves = (("mismatch/max", "max |dlogp|", "tab:red"), ("mismatch/mean", "mean |dlogp|", "tab:orange"))
    for key, label, color in curves:
        values = [h.get(key, math.nan) for h in history]
        bottom.plot(steps, [v if v and v > 0 else math.nan for v in values], label=label, color=color)
    bottom.axhline(MISMATCH_TARGET, color="grey", lw=0.8, ls="--", label=f"target {MISMATCH_TARGET:g}")
    bottom.set_yscale("log")
    bottom.set_ylabel("|engine - trainer| log-prob")
    bottom.set_xlabel("step (= policy version)")
    bottom.legend(loc="lower left")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""Before/after: run two commits' own benchmarks, interleaved, and print each figure's medians side by side.

For each rev the commit's tree is extracted (`git archive`) into a temporary directory, and every
run is that tree's own `bench/NAME.py` in a subprocess, with `PYTHONPATH` = that tree (checked
once per tree: `import inference` must resolve inside it), so each commit's engine and bench are
measured. Runs interleave, per repeat and bench: before, after (B A B A ...). The temporary trees
are removed on every exit path (errors, Ctrl-C, SIGTERM).

Figures come from a bench's `RESULT {json}` lines when it prints them (merged, see
`common.print_result`), else from its human-readable stdout by the regexes below, so commits
from before `RESULT` existed (fef436a) compare too:

* step_overhead `step_ms[B]`: the engine's own time per decode step at B active requests, the
  `step` column of the table after the "-- stand-in model" line: `STEP_ROW`.
* rollout_throughput `engine_tok_s[MODEL]`: the engine's useful tokens/s, the `useful tok/s`
  column of the "engine (n=1 per sample)" row of the table after "== MODEL:": `ENGINE_ROW`.

Usage: `python bench/throughput/compare_commits.py --before REV --after REV --bench step_overhead
--bench rollout_throughput [--repeats 5] [--quick] [--bench-args NAME="ARGS"] [--after-args NAME="ARGS"]
[-- ARGS for every bench]`. `--after-args` go to the after side only: for a flag its bench added
that changes nothing compared (e.g. `--no-hf-static`, which skips a peer the before tree lacks).
rollout_throughput runs with `--model tiny --repeats 1 --hf-batch 8 --no-hf-continuous` first
(its peers are not compared here; a later argument wins). Exits 1 if a run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

RESULT_PREFIX = "RESULT "  # NOTE: common.RESULT_PREFIX; not imported, so no torch loads here
STEP_SECTION = re.compile(r"^-- stand-in model")
STEP_ROW = re.compile(r"^\s*(?P<active>\d+)\s+(?P<step_ms>\d+\.\d+)\s")
MODEL_SECTION = re.compile(r"^== (?P<model>\w+):")
ENGINE_ROW = re.compile(r"^engine \(n=1 per sample\)\s+[\d,]+\s+[\d,]+\s+[\d.]+\s+(?P<tok_s>[\d.]+)\s")
DEFAULT_ARGS = {"rollout_throughput": ["--model", "tiny", "--repeats", "1", "--hf-batch", "8", "--no-hf-continuous"]}
# the figures each bench is compared on; others it reports in RESULT lines are shown too
KEY_FIGURES = {
    "step_overhead": ["step_ms[16]", "step_ms[64]", "step_ms[256]"],
    "rollout_throughput": ["engine_tok_s[tiny]"],
}


def parse_step_overhead(stdout: str) -> dict[str, float]:
    figures, inside = {}, False
    for line in stdout.splitlines():
        if STEP_SECTION.match(line):
            inside = True
        elif inside and not line.strip() and figures:
            break
        elif inside and (m := STEP_ROW.match(line)):
            figures[f"step_ms[{m['active']}]"] = float(m["step_ms"])
    return figures


def parse_rollout_throughput(stdout: str) -> dict[str, float]:
    figures, model = {}, None
    for line in stdout.splitlines():
        if m := MODEL_SECTION.match(line):
            model = m["model"]
        elif model and (m := ENGINE_ROW.match(line)):
            figures[f"engine_tok_s[{model}]"] = float(m["tok_s"])
    return figures


FALLBACK_PARSERS = {"step_overhead": parse_step_overhead, "rollout_throughput": parse_rollout_throughput}


def figures_of(bench: str, stdout: str) -> tuple[dict[str, float], str]:
    """(figures, source): the merged `RESULT` lines if any, else the bench's fallback regexes."""
    results = [json.loads(line[len(RESULT_PREFIX) :]) for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if results:
        return {k: float(v) for r in results for k, v in r["figures"].items()}, "RESULT"
    parser = FALLBACK_PARSERS.get(bench)
    return (parser(stdout) if parser else {}), "regex"


@dataclass(slots=True)
class Side:
    """One rev: its extracted tree and, per bench, every run's figures."""

    label: str
    rev: str
    commit: str
    tree: Path
    runs: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    sources: set[str] = field(default_factory=set)


def _git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def extract(repo: Path, commit: str, into: Path) -> None:
    """The commit's tracked files under `into` (`git archive | tar -x`): no worktree is registered."""
    into.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", str(repo), "archive", "--format=tar", commit], stdout=subprocess.PIPE)
    try:
        subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, check=True)
    finally:
        archive.stdout.close()
        if archive.wait() != 0:
            raise RuntimeError(f"git archive {commit} failed")


def bench_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def check_imports_from(tree: Path) -> None:
    code = "import inference; print(inference.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env=bench_env(tree), cwd=tree, check=True,
                         capture_output=True, text=True).stdout.strip()  # fmt: skip
    if not Path(out).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"`import inference` resolves to {out}, not inside {tree}: PYTHONPATH is shadowed")


def bench_script(tree: Path, bench: str) -> Path | None:
    """`tree`'s own script of `bench`: `bench/NAME.py` (commits before the benches had folders), else
    `bench/SUBJECT/NAME.py`."""
    flat = tree / "bench" / f"{bench}.py"
    found = [flat] if flat.is_file() else sorted((tree / "bench").glob(f"*/{bench}.py"))
    return found[0] if len(found) == 1 else None


def run_bench(side: Side, bench: str, args: list[str], timeout: float | None) -> float:
    """One run of `side`'s own bench; its figures are appended to `side.runs`. Returns wall seconds."""
    script = bench_script(side.tree, bench)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(script), *args], env=bench_env(side.tree), cwd=side.tree,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise RuntimeError(f"{side.label} ({side.rev}) {bench} exited {proc.returncode}:\n{tail}")
    figures, source = figures_of(bench, proc.stdout)
    if not figures:
        raise RuntimeError(f"{side.label} ({side.rev}) {bench}: no figures found in its output")
    side.runs.setdefault(bench, []).append(figures)
    side.sources.add(f"{bench}: {source}")
    return wall


def _stats(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{statistics.median(values):.4g} [{min(values):.4g}-{max(values):.4g}]"


def report(before: Side, after: Side, benches: list[str]) -> None:
    print(f"\nbefore = {before.rev} ({before.commit[:10]}), after = {after.rev} ({after.commit[:10]})")
    print(f"figures from: before {sorted(before.sources)}, after {sorted(after.sources)}")
    header = (
        f"{'bench':<20} {'figure':<24} {'before median [min-max]':>26} {'after median [min-max]':>26} "
        f"{'after/before':>12}"
    )
    print(header)
    print("-" * len(header))
    for bench in benches:
        b_runs, a_runs = before.runs.get(bench, []), after.runs.get(bench, [])
        b_names, a_names = {k for r in b_runs for k in r}, {k for r in a_runs for k in r}
        key = KEY_FIGURES.get(bench, [])
        both = [k for k in key if k in b_names & a_names] + sorted((b_names & a_names) - set(key))
        for name in both:
            b = [r[name] for r in b_runs if name in r]
            a = [r[name] for r in a_runs if name in r]
            ratio = statistics.median(a) / statistics.median(b)
            print(f"{bench:<20} {name:<24} {_stats(b):>26} {_stats(a):>26} {ratio:>12.3f}")
        for label, only in (("before", b_names - a_names), ("after", a_names - b_names)):
            if only:
                print(f"{bench:<20} only {label} printed: {', '.join(sorted(only))}")
        missing = [k for k in key if k not in b_names & a_names]
        if missing:
            print(f"{bench:<20} NOT compared (not printed by both with these arguments): {', '.join(missing)}")
    print("(ms figures: lower is better; tok/s: higher is better)")


def _per_bench(parser: argparse.ArgumentParser, flag: str, items: list[str]) -> dict[str, list[str]]:
    per_bench: dict[str, list[str]] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep:
            parser.error(f"{flag} takes NAME=ARGS, got {item!r}")
        per_bench.setdefault(name, []).extend(shlex.split(text))
    return per_bench


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="rev whose tree is 'before'")
    parser.add_argument("--after", required=True, help="rev whose tree is 'after'")
    parser.add_argument("--bench", action="append", required=True, help="bench name (bench/NAME.py); repeatable")
    parser.add_argument("--repeats", type=int, default=5, help="runs per side and bench, interleaved (>= 5 advised)")
    parser.add_argument("--bench-args", action="append", default=[], metavar='NAME="ARGS"',
                        help="extra arguments for one bench, after the shared ones")  # fmt: skip
    parser.add_argument("--after-args", action="append", default=[], metavar='NAME="ARGS"',
                        help="arguments for one bench on the after side only: a flag the before tree's bench "
                             "lacks that leaves the compared figures alone (e.g. skipping a peer it added)")
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent, help="a path in the git repo")
    parser.add_argument("--timeout", type=float, default=None, help="seconds allowed per bench run")
    parser.add_argument("--quick", action="store_true", help="pass --quick to every bench (smoke run)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    args.per_bench = _per_bench(parser, "--bench-args", args.bench_args)
    args.after_only = _per_bench(parser, "--after-args", args.after_args)
    return args, (["--quick"] if args.quick else []) + extra


def _raise_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # NOTE: unwinds through `finally`, so the trees are removed


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    if args.repeats < 5:
        print(f"note: {args.repeats} repeats; at least 5 are advised on a shared machine", file=sys.stderr)
    repo = Path(_git(args.repo, "rev-parse", "--show-toplevel"))
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    root = Path(tempfile.mkdtemp(prefix="compare_commits."))
    try:
        sides = []
        for label, rev in (("before", args.before), ("after", args.after)):
            commit = _git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}")
            side = Side(label, rev, commit, root / label)
            extract(repo, commit, side.tree)
            check_imports_from(side.tree)
            for bench in args.bench:
                if bench_script(side.tree, bench) is None:
                    raise RuntimeError(f"{rev} has no bench/{bench}.py nor bench/*/{bench}.py")
            sides.append(side)
        before, after = sides
        for repeat in range(args.repeats):
            for bench in args.bench:
                bench_args = [*DEFAULT_ARGS.get(bench, []), *extra, *args.per_bench.get(bench, [])]
                for side in (before, after):
                    own = args.after_only.get(bench, []) if side is after else []
                    wall = run_bench(side, bench, [*bench_args, *own], args.timeout)
                    shown = ", ".join(f"{k} {v:.4g}" for k, v in side.runs[bench][-1].items())
                    print(f"[{repeat + 1}/{args.repeats}] {bench} {side.label}: {wall:.0f} s; {shown}", flush=True)
        report(before, after, args.bench)
        return 0
    except (RuntimeError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

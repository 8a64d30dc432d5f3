"""Every doc's Python snippets run as written: the README and each `docs/*.md`, each in a namespace of
its own, its blocks in order (a reader pastes a doc top to bottom: its first blocks are its prelude).

A block's fence says how it runs: ```python (in `make test`), ```python stress (an HTTP server or a
Ray instance: `make stress`; `stress ray` skips without Ray), ```python demo (the colocated loop,
cut to 3 steps in `make test`, whole under `make stress`), ```python excerpt (read, not run: it needs
a trainer, several processes or a trained adapter from elsewhere; those calls run in the tests).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KINDS = {"", "stress", "stress ray", "demo", "excerpt"}
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```", flags=re.S | re.M)


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    kind: str
    code: str

    def run(self, namespace: dict, code: str | None = None) -> None:
        # NOTE: blank lines before the code keep a traceback's line numbers the doc's own
        exec(compile("\n" * self.line + (self.code if code is None else code), str(self.doc), "exec"), namespace)


def blocks(doc: Path, text: str | None = None) -> list[Block]:
    text = doc.read_text() if text is None else text
    found = []
    for m in FENCE.finditer(text):
        kind = m.group(1).strip()
        if kind not in KINDS:
            raise ValueError(f"{doc.name}:{text[:m.start()].count(chr(10)) + 1}: ```python {kind}: not one of "
                             f"{sorted(KINDS)}")
        found.append(Block(doc, text[:m.start()].count("\n") + 1, kind, m.group(2)))
    return found


def run_doc(doc_blocks: list[Block], kinds: set[str]) -> None:
    """`doc_blocks` of `kinds`, in order, in one fresh namespace."""
    namespace: dict = {}
    for block in doc_blocks:
        if block.kind in kinds:
            block.run(namespace)


def _ids(docs: list[Path]) -> list[str]:
    return [d.relative_to(ROOT).as_posix() for d in docs]


def test_the_readme_and_docs_have_snippets():
    assert sum(len(blocks(d)) for d in DOCS) >= 20


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_a_doc_s_snippets_run(doc):
    run_doc(blocks(doc), {""})


def test_a_broken_snippet_fails_its_doc(tmp_path):
    doc = tmp_path / "broken.md"
    doc.write_text("# A doc\n\n```python\nx = 1\n```\n\ntext\n\n```python\ny = x + undefined_name\n```\n")
    with pytest.raises(NameError) as info:
        run_doc(blocks(doc), {""})
    assert info.traceback[-1].lineno + 1 == 10  # NOTE: the doc's own line of the broken block
    with pytest.raises(ValueError, match="```python slow: not one of"):
        blocks(doc, "```python slow\nx = 1\n```\n")


def demo_block() -> Block:
    (block,) = [b for d in DOCS for b in blocks(d) if b.kind == "demo"]
    return block


def test_the_colocated_demo_runs_its_first_steps(capsys):
    """The snippet as written, its loop cut to 3 steps (the 200-step run learns: `make stress` below;
    `tests/rollout/rl/test_colocated.py::test_the_demo_learns` runs the same demo in `make test`)."""
    block = demo_block()
    assert block.code.count("range(200)") == 1
    block.run({}, block.code.replace("range(200)", "range(3)"))
    (line,) = capsys.readouterr().out.strip().splitlines()  # step 0's
    assert line.startswith("step   0  reward") and float(line.split("max")[1]) <= 1e-5


@pytest.mark.stress  # 200 steps, ~50 s on 2 cores
def test_the_colocated_demo_learns(capsys):
    demo_block().run({})
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert float(last.split("reward")[1].split()[0]) >= 0.9


# a measured figure, as the benchmarks page writes them: a number with a unit, or a ratio (1.43x)
UNITS = r"(?:ms|us|µs|s|tok/s|tokens/s|req/s|GB/s|MB/s|GFLOP/s|TFLOP/s|MB|GB|GiB|MiB|KB|%)"
FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?\s?" + UNITS + r"|\d+\.\d+x)(?![\w/])")
# settings the pages name that a measurement on the benchmarks page also happens to name (not figures)
SETTINGS = {"32MiB": "--http-max-body-bytes' default; gloo's broadcast piece", "256MiB": "the grammar compiler's stack",
            "512MiB": "a weight bucket's default size", "10%": "the storm test's bound on RSS growth"}
BENCHMARKS = ROOT / "docs" / "benchmarks.md"


def figures(text: str) -> set[str]:
    """The figures of `text`'s prose (code blocks left out), spaces dropped: `1.5 s` -> `1.5s`."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return {m.group(1).replace(" ", "") for m in FIGURE.finditer(prose)}


def misplaced_figures(text: str, benchmarks: str) -> set[str]:
    return (figures(text) & figures(benchmarks)) - set(SETTINGS)


@pytest.mark.parametrize("doc", [d for d in DOCS if d != BENCHMARKS], ids=_ids([d for d in DOCS if d != BENCHMARKS]))
def test_measured_figures_live_on_the_benchmarks_page_only(doc):
    assert not misplaced_figures(doc.read_text(), BENCHMARKS.read_text()), "move them to docs/benchmarks.md"


def test_a_figure_of_the_benchmarks_page_elsewhere_is_caught():
    bench = "GRPO 16 x n=8 bf16: 890 vs 577 tok/s, **1.54x**; a step 41.2 s; 18.6 MiB"
    assert misplaced_figures("we lead by 1.54x here, 577 tok/s", bench) == {"1.54x", "577tok/s"}
    assert misplaced_figures("a request of 18.6MiB took 41.2 s (a 32 MiB body limit)", bench) == {"18.6MiB", "41.2s"}
    assert not misplaced_figures("see docs/benchmarks.md; version 1.54 of x, step 41", bench)


LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    prose = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", prose, flags=re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_link_between_docs_lands(doc):
    for target in LINK.findall(re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        assert file.exists(), f"{doc.name}: {target}: no such file"
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file), f"{doc.name}: {target}: no such heading"


STRESSED = [d for d in DOCS if any(b.kind.startswith("stress") for b in blocks(d))]


@pytest.mark.stress  # HTTP servers on SmolLM2 (~15 s each on 2 cores), a local Ray instance
@pytest.mark.parametrize("doc", STRESSED, ids=_ids(STRESSED))
def test_a_doc_s_server_snippets_run(doc):
    doc_blocks = blocks(doc)
    kinds = {"", "stress"}
    if any(b.kind == "stress ray" for b in doc_blocks):
        pytest.importorskip("ray")
        kinds.add("stress ray")
    run_doc(doc_blocks, kinds)

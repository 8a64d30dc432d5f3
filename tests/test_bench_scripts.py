"""Every bench under `bench/` imports, and every script answers `--help`, all in one process (no
`sys.path` tricks: the benches are the `bench` package, their shared helpers `bench.common`)."""

from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHES = sorted(p for p in (ROOT / "bench").rglob("*.py") if p.name != "__init__.py")


def module_of(path: Path) -> str:
    return ".".join(("bench", *path.relative_to(ROOT / "bench").with_suffix("").parts))


def test_the_benches_are_in_subject_folders_with_a_readme():
    assert {p.parent.name for p in BENCHES} - {"bench"} == {"throughput", "service", "weights", "speculation", "lora",
                                                           "clients"}
    assert [p.name for p in BENCHES if p.parent.name == "bench"] == ["common.py"]
    readme = (ROOT / "bench" / "README.md").read_text()
    missing = [p.relative_to(ROOT).as_posix() for p in BENCHES if p.relative_to(ROOT).as_posix() not in readme]
    assert not missing, f"bench/README.md does not say what these answer: {missing}"


def test_every_bench_imports_and_every_script_answers_help(monkeypatch, capsys):
    for path in BENCHES:
        importlib.import_module(module_of(path))
        if 'if __name__ == "__main__"' not in path.read_text():
            continue  # a helper module of the benches, not a script
        monkeypatch.setattr(sys, "argv", [str(path), "--help"])
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(path), run_name="__main__")
        assert done.value.code in (0, None), path
        assert "usage:" in capsys.readouterr().out.lower(), f"{path}: --help printed no usage"

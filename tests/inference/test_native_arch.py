"""ROLLOUT_ENGINE_KERNEL_ARCH: the kernels' -march is native, or a named x86-64 level the CPU has
(a level it lacks, or a name that is none, is refused by name)."""

from __future__ import annotations

import platform

import pytest

from inference import native

V3_CPU = ["model name\t: a Zen 3\n",
          "flags\t\t: " + " ".join(sorted(native.LEVEL_FLAGS["x86-64-v2"] | native.LEVEL_FLAGS["x86-64-v3"])) + "\n"]


@pytest.fixture
def zen3(monkeypatch):
    """A CPU with AVX2 and no AVX-512, whatever this machine is."""
    monkeypatch.setattr(native, "_cpu_lines", lambda: V3_CPU)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")


@pytest.mark.parametrize("name,arch", [("", "native"), ("native", "native"), ("v2", "x86-64-v2"),
                                       ("V3", "x86-64-v3"), ("x86-64-v3", "x86-64-v3")])
def test_levels_the_cpu_has(zen3, monkeypatch, name, arch):
    monkeypatch.setenv("ROLLOUT_ENGINE_KERNEL_ARCH", name)
    assert native.target_arch() == arch


def test_a_level_the_cpu_lacks_is_refused_naming_what_is_missing(zen3, monkeypatch):
    monkeypatch.setenv("ROLLOUT_ENGINE_KERNEL_ARCH", "v4")
    with pytest.raises(ValueError, match="lacks avx512bw, avx512cd, avx512dq, avx512f, avx512vl"):
        native.target_arch()


@pytest.mark.parametrize("name", ["v5", "haswell", "-O0"])
def test_a_name_that_is_no_level_is_refused(zen3, monkeypatch, name):
    monkeypatch.setenv("ROLLOUT_ENGINE_KERNEL_ARCH", name)
    with pytest.raises(ValueError, match="expected native, v2, v3 or v4"):
        native.target_arch()


def test_a_level_is_refused_off_x86(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setenv("ROLLOUT_ENGINE_KERNEL_ARCH", "v2")
    with pytest.raises(ValueError, match="aarch64"):
        native.target_arch()

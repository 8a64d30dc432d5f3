"""Fixtures shared by the inference tests."""

from __future__ import annotations

import pytest

from tests.inference.native_util import kernels_on


@pytest.fixture
def native_kernels():
    """The native kernels on for one test, whatever ROLLOUT_ENGINE_NO_KERNELS says (see native_util)."""
    with kernels_on():
        yield

"""Kernel unit tests run the native kernels whatever `ROLLOUT_ENGINE_NO_KERNELS` says.

That switch is how CI simulates a machine without the kernels for the rest of the suite; a test
of the kernels themselves skips only where they cannot be built: no C compiler.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

from inference import native

SWITCH = "ROLLOUT_ENGINE_NO_KERNELS"

needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")


@contextlib.contextmanager
def kernels_on() -> Iterator[None]:
    """The native kernels loaded for the block (the switch cleared), as the environment had them after.

    NOTE: `native.library()` is cached, and some objects decide at construction whether to use a
    kernel (`TorchAttentionBackend`), so build them inside the block.
    """
    saved = os.environ.pop(SWITCH, None)
    native.library.cache_clear()
    try:
        assert native.available(), "a C compiler is here, yet the native kernels did not build"
        yield
    finally:
        if saved is not None:
            os.environ[SWITCH] = saved
        native.library.cache_clear()

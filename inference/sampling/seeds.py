"""Seeds: a seeded row's own generator, and the seed of each of a request's n samples."""

from __future__ import annotations

import torch


def make_generator(seed: int, device: torch.device | str | None = None) -> torch.Generator:
    """A generator for one seeded row, on the device its uniforms are drawn on."""
    return torch.Generator(device=device or "cpu").manual_seed(seed)


_MASK64 = (1 << 64) - 1


def sample_seed(seed: int, index: int) -> int:
    """The 64-bit seed of sample `index` of a request seeded `seed` (a splitmix64-style mix).

    NOTE: `seed + index` would make sample 1 of seed s replay sample 0 of seed s + 1; mixing both
    inputs through the finaliser makes nearby (seed, index) pairs give unrelated streams.
    """
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)

"""`rollout grpo` arguments -> GRPOConfig (presets, then the flags given)."""

from __future__ import annotations

import pytest

from rollout.cli import build_parser, config_from_args
from rollout.rl.colocated import GRPOConfig, ModelKind


def parse(*argv):
    return config_from_args(build_parser().parse_args(["grpo", *argv]))


def test_defaults_are_the_demo():
    assert parse() == GRPOConfig()
    assert parse().threads == 1 and parse().wandb and parse().progress


def test_flags_override_the_preset():
    cfg = parse("--model", "smollm2", "--steps", "2", "-n", "4", "--no-wandb", "--no-progress")
    assert cfg.model is ModelKind.SMOLLM2 and cfg.steps == 2 and cfg.samples_per_prompt == 4
    assert cfg.lr == 5e-6 and cfg.temperature == 0.7 and cfg.threads is None  # from the preset
    assert not cfg.wandb and not cfg.progress


def test_invalid_values_name_the_field():
    with pytest.raises(ValueError, match="steps"):
        parse("--steps", "0")
    with pytest.raises(ValueError, match="lr"):
        GRPOConfig(lr=-1.0)

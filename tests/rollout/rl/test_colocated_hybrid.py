"""The colocated GRPO loop with a hybrid Mamba policy (`--model hybrid-tiny`): a few steps, with
the same checks as the dense demo (versions, cross-version hits, engine/trainer mismatch)."""

from __future__ import annotations

import torch

from inference.models.hybrid.decoder import HybridDecoder
from rollout.local import RolloutEngine
from rollout.rl.colocated import GRPOConfig, ModelKind, build_policy, run_grpo


def test_hybrid_tiny_runs_the_colocated_loop(tmp_path):
    cfg = GRPOConfig.preset("hybrid-tiny", steps=3, prompts_per_step=4, samples_per_prompt=4, out_dir=str(tmp_path),
                            run_name="h", wandb=False, progress=False, eval_every=2)
    assert cfg.model is ModelKind.HYBRID_TINY
    policy, _, _ = build_policy(cfg)
    assert isinstance(RolloutEngine(policy).engine.model, HybridDecoder)
    summary = run_grpo(cfg)
    assert summary.steps == 3 and summary.stale_tokens == 0 and summary.cross_version_hits == 0
    assert summary.mismatch_max <= 1e-5  # the engine's Mamba2 and the trainer's agree
    assert torch.get_num_threads() >= 1

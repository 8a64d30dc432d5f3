"""The disaggregated GRPO loop on real processes: a trainer here, two `rollout serve` replicas behind
a `rollout route` router (started once for the module, as the loop starts its own), weights
broadcast over gloo every step through the router.
A few small steps each way; the checks are the loop's own (per-token versions, no cross-version
prefix hit, replicas equal to a fresh engine at the end) plus the version sequence read back."""

from __future__ import annotations

import json

import pytest

from inference import native
from rollout.cli import main
from rollout.rl.colocated import GRPOConfig, build_policy
from rollout.rl.disaggregated import DisaggregatedConfig, Fleet, run_disaggregated_grpo, save_model, serve_args

SMALL = dict(prompts_per_step=8, samples_per_prompt=4, wandb=False, progress=False, table_every=100, eval_every=3)


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    cfg, dcfg = GRPOConfig(**SMALL), DisaggregatedConfig(replicas=2, sync_timeout_s=30.0)
    policy, task, _ = build_policy(cfg)
    model_dir = tmp_path_factory.mktemp("disaggregated") / "initial"
    save_model(policy, model_dir)
    fleet = Fleet.spawn(model_dir, 2, serve_args(cfg, dcfg, task))
    yield fleet.procs[0].address
    fleet.close()


def test_on_policy_every_step_samples_the_weights_the_trainer_just_sent(router, tmp_path):
    steps = 4
    cfg = GRPOConfig(steps=steps, out_dir=str(tmp_path), run_name="on", **SMALL)
    s = run_disaggregated_grpo(cfg, DisaggregatedConfig(router=router, sync_timeout_s=30.0))
    versions = [h["policy_version"] for h in s.run.history]
    assert versions == list(range(versions[0], versions[0] + steps))
    assert s.run.stale_tokens == 0 and s.run.cross_version_hits == 0 and s.max_staleness == 0
    # the replicas sampled with exactly the trainer's weights of that step: its recomputed
    # log-probs agree to float rounding (a missed or partial sync would be off by far more)
    assert s.run.mismatch_max <= 1e-5
    assert s.replicas_match_trainer
    assert s.replicas == 2 and all(h["time/weight_update"] > 0 for h in s.run.history)


def test_off_policy_overlaps_one_version_behind_through_the_cli(router, tmp_path, capsys):
    steps = 5
    argv = ["grpo", "--disaggregated", "--off-policy", "1", "--steps", str(steps), "--prompts", "8", "-n", "4",
            "--no-wandb", "--no-progress", "--table-every", "100", "--eval-every", "3", "--out-dir", str(tmp_path),
            "--run-name", "off", "--sync-timeout-s", "30", "--router", router]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 replicas" in out and "off-policy 1" in out
    assert "stale-version tokens: 0; cross-version prefix hits: 0" in out
    assert "== a fresh engine of the trainer's weights: True" in out and "max staleness 1 version(s)" in out
    history = [json.loads(line) for line in (tmp_path / "off" / "metrics.jsonl").read_text().splitlines()]
    # step k trains on samples of version k - 1 (generated while step k - 1 trained), step 0 on version 0
    first = history[0]["policy_version"]
    assert [h["policy_version"] - first for h in history] == [0] + list(range(steps - 1))
    assert [h["staleness"] for h in history] == [0] + [1] * (steps - 1)
    assert all(h["stale_tokens"] == 0 for h in history)


def test_vllm_family_calls_only_sample_each_step_with_the_weights_just_sent(tmp_path):
    """The loop as a trainer written for vLLM drives its engines (rollout.rl.vllm_family): its own
    two `rollout serve --http --skip-tokenizer-init` replicas, `/inference/v1/generate`, each sync
    `/pause?mode=keep`, vLLM's four phases in its packed layout over gloo, `/resume`."""
    steps = 3
    cfg = GRPOConfig(steps=steps, out_dir=str(tmp_path), run_name="vllm", **SMALL)
    s = run_disaggregated_grpo(cfg, DisaggregatedConfig(replicas=2, api="vllm", sync_timeout_s=30.0))
    versions = [h["policy_version"] for h in s.run.history]
    assert versions == list(range(versions[0], versions[0] + steps))
    assert s.run.stale_tokens == 0 and s.max_staleness == 0  # every token's version, read from its spans
    assert s.run.cross_version_hits == 0  # read from the replicas' /metrics
    assert s.run.mismatch_max <= 1e-5
    assert s.replicas_match_trainer and s.replicas == 2


def test_vllm_family_refuses_what_it_does_not_speak():
    with pytest.raises(ValueError, match="vLLM's calls only"):
        DisaggregatedConfig(api="vllm", router="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="vLLM's calls only"):
        DisaggregatedConfig(api="vllm", transport="shm")


def test_a_lora_run_syncs_the_adapter_alone_each_step_and_samples_the_version_just_sent(router, tmp_path):
    """`GRPOConfig.lora_rank`: after one full sync of the base, each step moves only the adapter's
    tensors (its next version on both replicas) and every request names it."""
    steps, rank = 3, 4
    cfg = GRPOConfig(steps=steps, out_dir=str(tmp_path), run_name="lora", lora_rank=rank, **SMALL)
    s = run_disaggregated_grpo(cfg, DisaggregatedConfig(router=router, sync_timeout_s=30.0))
    history = s.run.history
    # the adapter's bytes: A [r, in] and B [out, r] of 7 projections x 2 layers, fp32 (no padding at these sizes)
    policy, _, _ = build_policy(cfg)
    layer = policy.model.layers[0]
    projs = [*(getattr(layer.self_attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
             *(getattr(layer.mlp, p) for p in ("gate_proj", "up_proj", "down_proj"))]
    adapter_bytes = len(policy.model.layers) * sum(4 * rank * (m.in_features + m.out_features) for m in projs)
    assert [h["weight_sync/bytes"] for h in history] == [adapter_bytes] * steps
    assert [h["lora_version"] - history[0]["lora_version"] for h in history] == list(range(steps))
    # the base never moved (every token carries its version), and each step sampled the adapter
    # just sent: the trainer's recomputed log-probs agree to float rounding (a stale one would not)
    assert len({h["policy_version"] for h in history}) == 1 and s.run.stale_tokens == 0
    assert s.run.mismatch_max <= 1e-5
    assert s.replicas_match_trainer and s.lora_rank == rank and s.sync_bytes == adapter_bytes


@pytest.mark.skipif(not native.available(), reason="native kernels not built")
def test_zero_mismatch_with_replicas_in_processes_of_their_own(tmp_path, capsys):
    """`rollout grpo --disaggregated --zero-mismatch`: the replicas (spawned here, batch-invariant) sample,
    the trainer's forward runs their kernels over its own weights, which every sync copies to them: each
    sampled token's trainer log-prob is its sampled one, bit for bit, every step."""
    steps = 3
    argv = ["grpo", "--disaggregated", "--zero-mismatch", "--steps", str(steps), "--prompts", "8", "-n", "4",
            "--no-wandb", "--no-progress", "--table-every", "100", "--eval-every", "3", "--out-dir", str(tmp_path),
            "--run-name", "zero", "--sync-timeout-s", "30", "--replicas", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "mismatch 0.00e+00 mean, 0.00e+00 max" in out and "; 0 differ)" in out
    history = [json.loads(line) for line in (tmp_path / "zero" / "metrics.jsonl").read_text().splitlines()]
    assert len(history) == steps and all(h["mismatch/tokens"] == 0 and h["mismatch/max"] == 0 for h in history)
    assert sum(h["completion_tokens"] for h in history) > 0
    with pytest.raises(ValueError, match="on policy"):
        run_disaggregated_grpo(GRPOConfig(zero_mismatch=True, **SMALL), DisaggregatedConfig(off_policy=1))
    with pytest.raises(ValueError, match="replica_dtype float32"):
        run_disaggregated_grpo(GRPOConfig(zero_mismatch=True, **SMALL), DisaggregatedConfig(replica_dtype="bfloat16"))

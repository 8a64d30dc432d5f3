"""Records `wire_golden.json`: every wire message as its bytes, to pin the protocol across refactors.

    python -m tests.rollout.wire.record_wire_golden      # rewrites tests/rollout/wire/wire_golden.json

Run once, at the commit whose bytes are the reference (the file says which); `test_wire_golden.py`
checks the current code against it. Each entry is one message: its frame (hex), and the fields it
was built from (`given`), so a test can build it again from the class the frame decodes to and
compare bytes, which also pins every default the builder left out.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np

from inference import (
    FinishReason,
    LogprobsMode,
    PauseMode,
    SamplingParams,
    Staging,
    StructuredOutputs,
    SuspendPolicy,
    UpdatePolicy,
)
from rollout.wire import codec, kinds
from rollout.wire import messages as wire
from weight_sync import AdapterSource, DeltaSource, DiskSource, DistributedSource, SharedMemorySource, VersionSource
from weight_sync.delta_manifest import DeltaManifest, Encoding, TensorChange
from weight_sync.manifest import Bucket, Layout, Manifest
from weight_sync.sources import CudaIpcBuffer

OUT = Path(__file__).with_name("wire_golden.json")
# every name the recorder builds with, in one namespace
p = SimpleNamespace(**{**vars(wire), **vars(kinds), "encode": codec.encode, "PauseMode": PauseMode,
                       "SuspendPolicy": SuspendPolicy, "UpdatePolicy": UpdatePolicy})


def manifest(layout: bool = True) -> Manifest:
    return Manifest(names=["model.embed_tokens.weight", "lm_head.weight"], dtypes=["float32", "bfloat16"],
                    shapes=[[16, 8], [16, 8]], version=7, total_bytes=768,
                    layout=Layout(offsets=[0, 512], buckets=[Bucket(0, 2, 768, 2**63 + 5)]) if layout else None)


def adapter_manifest() -> Manifest:
    """One layer's q_proj LoRA of rank 8 (PEFT's names) in one bucket."""
    names = [f"base_model.model.model.layers.0.self_attn.q_proj.lora_{ab}.weight" for ab in "AB"]
    return Manifest(names=names, dtypes=["float32", "float32"], shapes=[[8, 16], [16, 8]], version=3,
                    layout=Layout(offsets=[0, 512], buckets=[Bucket(0, 2, 1024, 2**63 + 9)]))


def delta_manifest(base_version) -> DeltaManifest:
    """Two bf16 tensors: one changed in 3 words (sparse), one unchanged; or (no base) both in full."""
    if base_version is None:
        changes = [TensorChange(Encoding.FULL, 8, 0, 16), TensorChange(Encoding.FULL, 4, 16, 8)]
    else:
        changes = [TensorChange(Encoding.SPARSE, 3, 0, 18), TensorChange(Encoding.UNCHANGED, 0, 24, 0)]
    return DeltaManifest(names=["a.weight", "b.weight"], dtypes=["bfloat16", "bfloat16"], shapes=[[2, 4], [4]],
                         changes=changes, base_version=base_version, version=5, weights_hash=bytes(range(16)),
                         payload_bytes=64, payload_checksum=2**64 - 1)


def messages() -> dict[str, tuple[msgspec.Struct, list[str]]]:
    ids = np.array([1, 2, 3], dtype=np.int32)
    full_sampling = SamplingParams(n=4, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=2**63, max_tokens=32,
                                   stop_token_ids=[2, 7], ignore_eos=True, logprobs=3, prompt_logprobs=2,
                                   logprobs_mode=LogprobsMode.PROCESSED, return_routed_experts=True,
                                   repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-0.25, min_tokens=4,
                                   logit_bias={5: -100.0, 9: 2.5}, bad_words_token_ids=[[3], [4, 6]],
                                   allowed_token_ids=[1, 2, 5, 9], cache_salt="tenant-a",
                                   structured_outputs=StructuredOutputs(json='{"type": "object"}',
                                                                        disable_any_whitespace=True),
                                   lora_name="math-v3")
    routes = p.RoutedExperts(layers=2, k=2, experts=np.arange(4 * 2 * 2, dtype=np.int32))
    out: dict[str, tuple[msgspec.Struct, list[str]]] = {
        "generate_minimal": (p.Generate(request_id="r1", prompt_token_ids=ids), ["request_id", "prompt_token_ids"]),
        "generate_full": (p.Generate(request_id="s-r2", prompt_token_ids=ids, sampling=full_sampling,
                                     stream_tokens=True, session_id="sess", group_id="grp", client="c0ffee"), []),
        "abort": (p.Abort(request_id="a1", targets=["r1", "r2"]), ["request_id", "targets"]),
        "continue": (p.Continue(request_id="c1"), ["request_id"]),
        "suspend_minimal": (p.Suspend(request_id="c2"), ["request_id"]),
        "suspend_full": (p.Suspend(request_id="c3", policy=p.SuspendPolicy.OFFLOAD, offload_weights=True,
                                   tags=["kv_cache", "weights"], discard_weights=True), []),
        "resume": (p.Resume(request_id="c4"), ["request_id"]),
        "resume_tags": (p.Resume(request_id="c5", tags=["weights"]), []),
        "update_disk_minimal": (p.UpdateWeights(request_id="u1", source=DiskSource(path="/w")),
                                ["request_id", "source"]),
        "update_version_only": (p.UpdateWeights(request_id="u10", source=VersionSource(version=12),
                                                policy=p.UpdatePolicy.KEEP), []),
        "update_disk_full": (p.UpdateWeights(request_id="u2", source=DiskSource(path="/w", version=3),
                                             policy=p.UpdatePolicy.KEEP), []),
        "update_distributed": (p.UpdateWeights(request_id="u3", source=DistributedSource(
            manifest=manifest(), group_name="g1", finish=True, staging=Staging.IN_PLACE),
            policy=p.UpdatePolicy.RECOMPUTE), []),
        "update_distributed_unpacked": (p.UpdateWeights(request_id="u4", source=DistributedSource(
            manifest=manifest(layout=False))), []),
        "update_distributed_vllm_packed": (p.UpdateWeights(request_id="u7", source=DistributedSource(
            manifest=manifest(layout=False), group_name="vllm_weight_transfer", finish=False,
            packed_buffer_bytes=1 << 30)), []),
        "update_shm": (p.UpdateWeights(request_id="u5", source=SharedMemorySource(
            manifest=manifest(), segment="rollout-wsync-1234-abcdef012345", token=99, piece_bytes=1 << 20)), []),
        "update_delta_group": (p.UpdateWeights(request_id="u8", source=DeltaSource(
            delta=delta_manifest(base_version=4), full=delta_manifest(base_version=None), group_name="g1")), []),
        "update_delta_shm": (p.UpdateWeights(request_id="u9", source=DeltaSource(
            delta=delta_manifest(base_version=4), segment="rollout-wsync-1234-abcdef012345", token=7,
            staging=Staging.DOUBLE)), []),
        "update_cuda_ipc": (p.UpdateWeights(request_id="u6", source=SharedMemorySource(
            manifest=manifest(),
            cuda_ipc=[CudaIpcBuffer(0, b"\x01\x02", 4096, 0, 128, b"\x03", 8, b"\x04", True)])), []),
        "init_group_minimal": (p.InitWeightsUpdateGroup(request_id="g1", master_address="127.0.0.1", master_port=29500,
                                                        world_size=3),
                               ["request_id", "master_address", "master_port", "world_size"]),
        "init_group_full": (p.InitWeightsUpdateGroup(request_id="g2", master_address="127.0.0.1", master_port=29500,
                                                     world_size=3, rank_offset=2, group_name="g", backend="gloo",
                                                     timeout_s=30.0), []),
        "destroy_group": (p.DestroyWeightsUpdateGroup(request_id="g3"), ["request_id"]),
        "get_weight_version": (p.GetWeightVersion(request_id="v1"), ["request_id"]),
        "reset_prefix_cache": (p.ResetPrefixCache(request_id="x1"), ["request_id"]),
        "is_sleeping": (p.IsSleeping(request_id="z1"), ["request_id"]),
        "result_is_sleeping": (p.Result(request_id="z1", request_kind=p.Kind.IS_SLEEPING, policy_version=3,
                                        sleeping=True), []),
        "load_lora": (p.LoadLora(request_id="l1", lora_name="math", lora_path="/adapters/math"),
                      ["request_id", "lora_name", "lora_path"]),
        "unload_lora": (p.UnloadLora(request_id="l2", lora_name="math"), ["request_id", "lora_name"]),
        "sync_lora_distributed": (p.SyncLora(request_id="l4", source=AdapterSource(
            name="policy", rank=8, alpha=16.0, target_modules=["q_proj"],
            payload=DistributedSource(manifest=adapter_manifest(), group_name="g"))), []),
        "sync_lora_shm": (p.SyncLora(request_id="l5", source=AdapterSource(
            name="policy", rank=8, alpha=16.0, rslora=True, target_modules=["q_proj"],
            payload=SharedMemorySource(manifest=adapter_manifest(), segment="rollout-wsync-12-0123456789abcdef",
                                       token=99))), []),
        "list_loras": (p.ListLoras(request_id="l3"), ["request_id"]),
        "result_loras": (p.Result(request_id="l3", request_kind=p.Kind.LIST_LORAS, policy_version=3,
                                  loras=[p.LoraInfo(name="math", version=2, rank=16, path="/adapters/math"),
                                         p.LoraInfo(name="code", version=1, rank=8)]), []),
        "stats": (p.Stats(request_id="s1"), ["request_id"]),
        "health": (p.Health(request_id="h1"), ["request_id"]),
        "heartbeat_minimal": (p.Heartbeat(request_id="hb1"), ["request_id"]),
        "heartbeat_full": (p.Heartbeat(request_id="hb2", lease_s=12.5), []),
        "kv_events_minimal": (p.KvEvents(request_id="k1"), ["request_id"]),
        "kv_events_full": (p.KvEvents(request_id="k2", since=5, max_events=10), []),
        "sample_output_minimal": (p.SampleOutput(request_id="r1", sample_index=0, n=1, prompt_len=3, token_ids=ids,
                                                 logprobs=np.array([-0.5, -1.0, -2.0], np.float32),
                                                 versions=np.array([4, 4, 5], np.int32),
                                                 finish_reason=FinishReason.STOP),
                                  ["request_id", "sample_index", "n", "prompt_len", "token_ids", "logprobs",
                                   "versions", "finish_reason"]),
        "sample_output_full": (p.SampleOutput(
            request_id="r1", sample_index=1, n=2, prompt_len=3, token_ids=ids[:2],
            logprobs=np.array([-0.5, -1.0], np.float32), versions=np.array([4, 4], np.int32),
            finish_reason=FinishReason.LENGTH, top_logprobs=[{1: -0.5, 2: -1.5}, {2: -1.0}],
            prompt_logprobs=[None, {2: -0.25}, {3: -0.75}], prompt_logprob_ranks=[None, 1, 4],
            ttft=0.01, latency=0.5, num_preemptions=1,
            routed_experts=routes, cached_tokens=2, lora_version=3), []),
        "token_delta": (p.TokenDelta(request_id="r1", sample_index=0, start=2, token_ids=ids[:1],
                                     logprobs=np.array([-0.1], np.float32), versions=np.array([3], np.int32)),
                        ["request_id", "sample_index", "start", "token_ids", "logprobs", "versions"]),
        "result_minimal": (p.Result(request_id="c1", request_kind=p.Kind.CONTINUE), ["request_id", "request_kind"]),
        "result_stats": (p.Result(request_id="s1", request_kind=p.Kind.STATS, policy_version=3,
                                  stats={"a": 1, "b": 0.5, "c": "x"}), []),
        "result_health": (p.Result(request_id="h1", request_kind=p.Kind.HEALTH, policy_version=3, health=p.HealthInfo(
            healthy=True, seconds_since_loop_tick=0.25, state="running", policy_version=3)), []),
        "result_health_not_generating": (p.Result(request_id="h2", request_kind=p.Kind.HEALTH, policy_version=3,
                                                  health=p.HealthInfo(healthy=True, seconds_since_loop_tick=0.25,
                                                                      state="running", policy_version=3,
                                                                      serving_error="weights discarded")), []),
        "result_kv_events": (p.Result(request_id="k1", request_kind=p.Kind.KV_EVENTS, policy_version=3,
                                      kv_events=p.KvEventBatch(block_size=16, start=0, next=2, reset=True, more=False,
                                                               events=[p.KvEvent(p.KvOp.STORED, [5, 6]),
                                                                       p.KvEvent(p.KvOp.CLEARED)])), []),
        "error_minimal": (p.ErrorReply(code=p.ErrorCode.BAD_SCHEMA, message="no"), ["code", "message"]),
        "error_full": (p.ErrorReply(code=p.ErrorCode.CONTEXT_OVERFLOW, message="too long", request_id="r1",
                                    context_error={"type": "TokenOverflowError", "request_id": 1, "is_transient": False,
                                                   "message": None}), []),
    }
    for mode in p.PauseMode:
        out[f"pause_{mode.value}"] = (p.Pause(request_id="p1", mode=mode), ["request_id", "mode"])
    return out


def main() -> None:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    entries = {name: {"frame": p.encode(msg).hex(), "given": given} for name, (msg, given) in messages().items()}
    OUT.write_text(json.dumps({"recorded_at": commit, "protocol_version": p.PROTOCOL_VERSION, "messages": entries},
                              indent=1, sort_keys=True) + "\n")
    print(f"{len(entries)} messages -> {OUT}")


if __name__ == "__main__":
    main()

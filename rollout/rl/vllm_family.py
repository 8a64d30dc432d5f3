"""The disaggregated GRPO loop's engines reached by vLLM-family calls only, as a trainer written for
vLLM drives them: `rollout serve --http` replicas (no router: such a trainer fans its control calls
out itself), generation by `/inference/v1/generate`, each sync `/pause?mode=keep`, vLLM's four
weight-transfer phases with our vLLM-layout sender over gloo, `/resume`.

`VllmFleet` and `VllmSender` stand in for `Fleet` and `WeightSender` in `rollout.rl.disaggregated`
(the same calls the loop makes of those): nothing of our own protocol is used.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import torch

from inference import FinishReason, LogprobsMode, SamplingParams
from rollout.server.process import ServerProcess
from rollout.types import Rollout, RolloutBatch
from weight_sync.vllm_trainer import VllmWeightTrainer

MODEL_NAME = "policy"
STAT_METRICS = {"engine/cross_version_prefix_hits": "rollout:prefix_cache_hits_cross_version"}


def expand_spans(spans: list[dict[str, int]]) -> list[int]:
    """`weight_versions` spans back to one version per token."""
    return [span["version"] for span in spans for _ in range(span["end"] - span["start"])]


class VllmHttpClient:
    """Generation and the version over HTTP (`urls`: one per replica, prompts spread over them)."""

    def __init__(self, urls: Sequence[str], timeout: float) -> None:
        self.urls, self.timeout = list(urls), timeout
        self.http = httpx.Client(timeout=timeout)
        self.pool = concurrent.futures.ThreadPoolExecutor(max(4, 2 * len(self.urls)), thread_name_prefix="vllm-http")

    def post(self, url: str, path: str, **kwargs: Any) -> Any:
        reply = self.http.post(url + path, **kwargs)
        if reply.status_code != 200:
            raise RuntimeError(f"POST {path} on {url}: {reply.status_code} {reply.text[:500]}")
        return reply.json() if reply.content else None

    def each(self, path: str, **kwargs: Any) -> None:
        for call in [self.pool.submit(self.post, url, path, **kwargs) for url in self.urls]:
            call.result()

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams, *,
                 url: str | None = None) -> RolloutBatch:
        start = time.perf_counter()
        body = {"n": n, "temperature": sampling.temperature, "max_tokens": sampling.max_tokens, "logprobs": 0,
                "logprobs_mode": "processed" if sampling.logprobs_mode is LogprobsMode.PROCESSED else "raw"}

        def request(group: int, prompt: Sequence[int]) -> dict[str, Any]:
            # NOTE: prompt i seeded `seed + i`, as our own client seeds a call's prompts (rollout.local)
            seeded = body if sampling.seed is None else {**body, "seed": sampling.seed + group}
            return {"token_ids": list(prompt), "model": MODEL_NAME, "sampling_params": seeded}

        calls = [self.pool.submit(self.post, url or self.urls[g % len(self.urls)], "/inference/v1/generate",
                                  json=request(g, p)) for g, p in enumerate(prompts)]
        rollouts = []
        for group, (prompt, call) in enumerate(zip(prompts, calls)):
            for choice in call.result()["choices"]:
                rollouts.append(Rollout(prompt_ids=list(prompt), completion_ids=choice["token_ids"],
                                        logprobs=[c["logprob"] for c in choice["logprobs"]["content"]],
                                        versions=expand_spans(choice["weight_versions"]),
                                        finish_reason=FinishReason(choice["finish_reason"]), group=group,
                                        sample_index=choice["index"]))
        return RolloutBatch.of_served(rollouts, prompts, n, time.perf_counter() - start, self.get_weight_version)

    def get_weight_version(self) -> int:
        return int(self.http.get(self.urls[0] + "/weight_info").json()["weight_version"])

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()


class VllmFleet:
    """`replicas` `rollout serve --http` processes, reached by vLLM-family calls only."""

    def __init__(self, procs: Sequence[ServerProcess], timeout: float) -> None:
        self.procs = list(procs)
        self.replicas = len(self.procs)
        self.client = VllmHttpClient([p.http_url for p in self.procs], timeout)

    @classmethod
    def spawn(cls, model_dir: Path, count: int, serve_args: Sequence[str], timeout: float) -> VllmFleet:
        procs: list[ServerProcess] = []
        try:
            for _ in range(count):
                # NOTE: the demo's model has no tokenizer: token ids in and out, as vLLM's RL trainers run it
                procs.append(ServerProcess(model_dir, *serve_args, "--http", "0", "--skip-tokenizer-init",
                                           "--served-model-name", MODEL_NAME, ready_timeout=timeout))
        except BaseException:
            for proc in procs:
                proc.stop(grace_s=5.0)
            raise
        return cls(procs, timeout)

    def stat(self, key: str) -> int:
        """An engine counter summed over the replicas, read from their `/metrics` (`STAT_METRICS`
        names the ones the loop asks for)."""
        from prometheus_client.parser import text_string_to_metric_families

        name, total = STAT_METRICS[key], 0
        for url in self.client.urls:
            text = self.client.http.get(url + "/metrics").text
            total += sum(int(sample.value) for family in text_string_to_metric_families(text)
                         for sample in family.samples if sample.name == name + "_total")
        return total

    def replica_addresses(self) -> list[str]:
        return list(self.client.urls)

    def close(self) -> None:
        self.client.close()
        for proc in self.procs:
            proc.stop(grace_s=5.0)


class VllmSender:
    """A sync as a vLLM trainer does it: `/pause?mode=keep` on every replica, vLLM's four phases
    (our vLLM-layout broadcast over gloo, packed), `/resume`."""

    def __init__(self, fleet: VllmFleet, timeout_s: float, dtype: torch.dtype | None = None) -> None:
        self.fleet, self.dtype = fleet, dtype
        self.trainer = VllmWeightTrainer(fleet.client.urls, backend="gloo", timeout_s=timeout_s)
        self.trainer.init()
        self.stats = SimpleNamespace(delta_syncs=0)

    def sync(self, policy: torch.nn.Module, version: int) -> int:
        named, seen = [], set()
        for name, tensor in policy.state_dict().items():
            if tensor.data_ptr() in seen:
                continue  # NOTE: a tied LM head is the embedding, sent once
            seen.add(tensor.data_ptr())
            tensor = tensor.detach()
            named.append((name, tensor if self.dtype is None else tensor.to(self.dtype)))
        client = self.fleet.client
        client.each("/pause", params={"mode": "keep"})
        try:
            return self.trainer.update(named, packed=True, weight_version=str(version))
        finally:
            client.each("/resume")

    def close(self) -> None:
        self.trainer.close()

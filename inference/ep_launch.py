"""Start one expert-parallel rank in this process: its process group, its slice of the experts, its
engine and the group's ZMQ step agreement.

Every rank of an EP group runs this with the same model directory, `world_size`, `dist_init`
(a `torch.distributed` init method: `tcp://127.0.0.1:PORT` or `file:///path`) and `ep_address`
(where rank 0 binds the ZMQ hub, loopback by default). The experts' collectives run on a group
whose timeout is `timeout_s`, like the communicator's, so a rank that dies makes the others fail
within it instead of hanging in a collective; only the start (rendezvous, loading, handshake) may
take `init_timeout_s` (ranks start at different times).
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from inference.config import InferenceConfig
from inference.core.ep_sync import EPCommunicator
from inference.engine import DynamicInferenceEngine
from inference.models.moe.spec import MoeSpec
from inference.models.parallel.expert_parallel import ExpertParallel


def start_ep_rank(model_dir: str | Path, config: Optional[InferenceConfig], *, rank: int, world_size: int,
                  dist_init: str, ep_address: str, timeout_s: float = 30.0, init_timeout_s: float = 120.0,
                  heartbeat_s: float = 0.01, backend: Optional[str] = None) -> DynamicInferenceEngine:
    """This process becomes EP rank `rank` of `world_size` serving the MoE checkpoint `model_dir`
    (only its experts are read and kept). Returns the engine, lockstep already set up: drive it
    with `step_until_ep_idle()` or its background loop. `backend`: gloo on CPU, nccl on CUDA."""
    config = config or InferenceConfig()
    backend = backend or ("nccl" if config.device.type == "cuda" else "gloo")
    spec = MoeSpec.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=dist_init, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=init_timeout_s))
    group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=timeout_s), backend=backend)
    ep = ExpertParallel(spec.num_experts, group)
    engine = DynamicInferenceEngine.from_pretrained(model_dir, config, expert_parallel=ep)
    communicator = EPCommunicator(rank, world_size, ep_address, timeout_s=timeout_s, connect_timeout_s=init_timeout_s)
    engine.set_ep_communicator(communicator, heartbeat_s=heartbeat_s)
    return engine

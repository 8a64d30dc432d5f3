"""The weight routes' calls: SGLang's names and fields (mapped onto weight_sync sources by
`rollout.client.weights`, owned by the weight-sync side) over the front's client.

Each awaits the client's `update_weights` / `join_group` / `leave_group`, which answer at the
update's commit (or the group's join) without holding up the event loop; a refusal raises, and the
route answers SGLang's `{"success": false}`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

from rollout.client.weights import disk_source, distributed_source, sglang_update, tensor_source
from rollout.http.core.clients import FrontClient
from weight_sync import DEFAULT_GROUP, WeightSource


class WeightCalls:
    """SGLang-named weight calls over `client`; `timeout` bounds each (None: the client's own)."""

    def __init__(self, client: FrontClient, timeout: Optional[float] = None) -> None:
        self.client, self.timeout = client, timeout

    async def _update(self, source: WeightSource, weight_version: Any, abort_all_requests: bool,
                      timeout: Optional[float]) -> int:
        source, policy = sglang_update(source, weight_version, abort_all_requests, None)
        return await self.client.update_weights(source, policy=policy, timeout=self._bound(timeout))

    def _bound(self, timeout: Optional[float]) -> Optional[float]:
        return self.timeout if timeout is None else timeout

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: Optional[int],
                                        world_size: int, group_name: str = DEFAULT_GROUP,
                                        backend: Optional[str] = None, *, timeout: Optional[float] = None) -> int:
        return await self.client.join_group(master_address, master_port, rank_offset, world_size, group_name,
                                            backend, timeout=self._bound(timeout))

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP, *,
                                           timeout: Optional[float] = None) -> None:
        await self.client.leave_group(group_name, timeout=self._bound(timeout))

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str = DEFAULT_GROUP, flush_cache: bool = True,
                                              abort_all_requests: bool = False, weight_version: Any = None,
                                              load_format: Optional[str] = None, *,
                                              timeout: Optional[float] = None) -> int:
        """One broadcast per tensor over `group_name`, committed once the model is complete;
        `flush_cache` is always in effect (the prefix cache never serves another version)."""
        source = distributed_source(names, dtypes, shapes, group_name, load_format)
        return await self._update(source, weight_version, abort_all_requests, timeout)

    async def update_weights_from_tensor(self, serialized_named_tensors: list[Union[bytes, str]],
                                         load_format: Optional[str] = None, flush_cache: bool = True,
                                         abort_all_requests: bool = False, weight_version: Any = None, *,
                                         timeout: Optional[float] = None) -> int:
        return await self._update(tensor_source(serialized_named_tensors, load_format), weight_version,
                                  abort_all_requests, timeout)

    async def update_weights_from_disk(self, model_path: Union[str, Path], load_format: Optional[str] = None,
                                       abort_all_requests: bool = False, weight_version: Any = None, *,
                                       timeout: Optional[float] = None) -> int:
        return await self._update(disk_source(model_path, load_format), weight_version, abort_all_requests,
                                  timeout)

"""A `WeightReceiver` that stands for an engine living elsewhere (a child process, a Ray actor).

Every protocol call becomes the engine's `<method>(*args, timeout)` on the other side (the Ray actor passes
`timeout` by keyword); a subclass only says how a call travels there (`_forward`) and who it is (`name`,
`tp_size`). The two proxies (`sync.process_receiver` over a
pipe, `loop.weight_sync.ActorReceiver` over Ray) share this one list of forwarded methods, so a method added to
the protocol cannot be forwarded by one and forgotten by the other.
"""

from __future__ import annotations

import abc
from typing import Any

from beamrl.protocols.weights import WeightReceiver


class ForwardingReceiver(WeightReceiver):
    """Forwards each `WeightReceiver` method by name with its arguments; `_forward` raises `WeightSyncError`."""

    @abc.abstractmethod
    def _forward(self, method: str, timeout: float, *args: Any) -> Any:
        """Run `method(*args, timeout)` on the remote engine; give up (raising `WeightSyncError`) after `timeout`
        seconds plus whatever slack the transport needs (Ray adds some, the pipe none)."""

    def begin_weight_update(self, timeout: float) -> None:
        self._forward("begin_weight_update", timeout)

    def update_weights_from_tensor(self, bucket, timeout: float) -> None:
        self._forward("update_weights_from_tensor", timeout, bucket)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str, timeout: float) -> None:
        self._forward("init_weights_update_group", timeout, master_address, master_port, rank_offset, world_size,
                      group_name, backend)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str, timeout: float) -> None:
        self._forward("update_weights_from_distributed", timeout, names, dtypes, shapes, group_name)

    def destroy_weights_update_group(self, group_name: str, timeout: float) -> None:
        self._forward("destroy_weights_update_group", timeout, group_name)

    def update_weights_from_disk(self, path: str, timeout: float) -> None:
        self._forward("update_weights_from_disk", timeout, path)

    def update_weight_version(self, new_version: int, timeout: float) -> None:
        self._forward("update_weight_version", timeout, new_version)

    def end_weight_update(self, new_version: int, timeout: float) -> None:
        self._forward("end_weight_update", timeout, new_version)

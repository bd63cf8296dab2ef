"""A `WeightReceiver` that stands for an engine living elsewhere (a child process, a Ray actor).

Every protocol call becomes the engine's `<method>(*args, timeout)` on the other side (the Ray actor passes
`timeout` by keyword); a subclass only says how a call travels there (`_submit`, returning a `PendingCall`) and
who it is (`name`, `tp_size`). `call_async` issues a call without waiting (the per-bucket calls of a sync are
pipelined this way; calls run in issue order on the other side). It also forwards the `RolloutEngine` calls a sync
makes (`abort_all` to pause, `score` to verify, `resume_memory` for colocated GPUs). The two proxies
(`sync.process_receiver` over a pipe, `loop.weight_sync.ActorReceiver` over Ray) share this one list of forwarded
methods, so a method added to the protocol cannot be forwarded by one and forgotten by the other.
"""

from __future__ import annotations

import abc
from typing import Any

from beamrl.protocols.weights import PendingCall, WeightReceiver


class ForwardingReceiver(WeightReceiver):
    """Forwards each `WeightReceiver` method by name with its arguments; failures raise `WeightSyncError`.
    `end_weight_update` also reads the version served after the commit, issued right behind it (one round trip;
    `served_version_after_commit` returns it)."""

    calls_in_issue_order = True  # every call, direct or `call_async`, travels down the one ordered channel
    bounded_calls = True  # every call is a `PendingCall` wait with the call's timeout
    _after_commit: int | BaseException | None = None  # what the read behind the last commit found

    @abc.abstractmethod
    def _submit(self, method: str, timeout: float, *args: Any) -> PendingCall:
        """Send `method(*args, timeout)` to the remote engine and return at once; the `PendingCall` gives up
        (raising `WeightSyncError`) after `timeout` seconds plus whatever slack the channel needs."""

    def _forward(self, method: str, timeout: float, *args: Any) -> Any:
        return self._submit(method, timeout, *args).wait(timeout)

    def call_async(self, method: str, timeout: float, *args: Any) -> PendingCall:
        return self._submit(method, timeout, *args)

    # -- WeightReceiver --------------------------------------------------------------------------------------
    def begin_weight_update(self, manifest, timeout: float) -> None:
        self._forward("begin_weight_update", timeout, manifest)

    def update_weights_from_tensor(self, bucket, timeout: float) -> None:
        self._forward("update_weights_from_tensor", timeout, bucket)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str, timeout: float) -> None:
        self._forward("init_weights_update_group", timeout, master_address, master_port, rank_offset, world_size,
                      group_name, backend)

    def update_weights_from_distributed(self, index: int, checksum, group_name: str, timeout: float) -> None:
        self._forward("update_weights_from_distributed", timeout, index, checksum, group_name)

    def destroy_weights_update_group(self, group_name: str, timeout: float) -> None:
        self._forward("destroy_weights_update_group", timeout, group_name)

    def update_weights_from_disk(self, path: str, timeout: float) -> None:
        self._forward("update_weights_from_disk", timeout, path)

    def update_weight_version(self, new_version: int, timeout: float) -> None:
        self._forward("update_weight_version", timeout, new_version)

    def end_weight_update(self, new_version: int, timeout: float) -> None:
        self._after_commit = None
        commit = self._submit("end_weight_update", timeout, new_version)
        served = self._submit("served_weight_version", timeout)  # runs right after the commit, on the engine
        commit.wait(timeout)  # a failed commit raises; the read behind it is dropped unread (it must not wait on
        # an engine that just failed, and nothing depends on it)
        try:
            self._after_commit = int(served.wait(timeout))
        except Exception as exc:  # the version check (served_version_after_commit) reports it
            self._after_commit = exc

    def served_version_after_commit(self, timeout: float) -> int:
        after, self._after_commit = self._after_commit, None
        if after is None:  # no commit since the last check: ask now
            return self.served_weight_version(timeout)
        if isinstance(after, BaseException):
            raise after
        return after

    def abort_weight_update(self, reason: str, timeout: float) -> str:
        return self._forward("abort_weight_update", timeout, reason)

    def served_weight_version(self, timeout: float) -> int:
        return int(self._forward("served_weight_version", timeout))

    def staging_supported(self, timeout: float) -> bool:
        return bool(self._forward("staging_supported", timeout))

    def attach_staging(self, slots: list, timeout: float) -> list:
        return self._forward("attach_staging", timeout, slots)

    def load_staged_bucket(self, slot: int, index: int, timeout: float) -> None:
        self._forward("load_staged_bucket", timeout, slot, index)

    def detach_staging(self, timeout: float) -> None:
        self._forward("detach_staging", timeout)

    # -- the RolloutEngine calls a sync makes ----------------------------------------------------------------
    def abort_all(self, timeout: float) -> None:
        self._forward("abort_all", timeout)

    def score(self, sequences: list[list[int]], timeout: float) -> list[list[float]]:
        return self._forward("score", timeout, sequences)

    def resume_memory(self, tags: list[str] | None, timeout: float) -> None:
        self._forward("resume_memory", timeout, tags)

    def weights_checksum(self, timeout: float) -> str:
        """The engine's own checksum of every parameter it computes with (tests, benchmarks)."""
        return self._forward("weights_checksum", timeout)

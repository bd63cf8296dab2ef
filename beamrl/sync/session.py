"""One versioned, optionally verified weight sync: pause -> begin -> buckets -> finalize(version+1) -> verify.

`WeightSyncManager` drives a `WeightTransport` with the trainer's streaming HF export. Any failure aborts the
session (engines touched by it are marked unhealthy by the transport and must be restarted) and raises
`WeightSyncError`; the manager then refuses further syncs until the engines are replaced. Nothing is resumed
half-updated and nothing fails silently: every engine reply is checked, the served version is checked, and
with `verify` the engines' prompt logprobs are compared with the trainer's on fixed probe sequences.

Pausing: engines are told `abort_all` (running requests come back with finish_reason 'abort'; the RL loop
resubmits them under the new version). The caller must not submit new requests during a sync. The prefix
cache is flushed by the engine when its session ends (when it is idle, so the flush cannot be refused).
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from beamrl.protocols.rollout import RolloutEngine
from beamrl.sync.bucketing import DEFAULT_BUCKET_BYTES, NamedTensors, bucketize
from beamrl.sync.calls import run_concurrently
from beamrl.protocols.weights import WeightSyncError
from beamrl.sync.protocol import WeightTransport


@dataclass(frozen=True)
class SyncTimeouts:
    """Seconds allowed for each kind of wait. Every engine call has one; none may be infinite."""

    connect: float = 300.0  # update-group rendezvous (engines join concurrently)
    call: float = 60.0  # begin/end session, version, pause
    bucket: float = 300.0  # one bucket: transfer + load on every engine
    verify: float = 120.0  # scoring the probe sequences

    def __post_init__(self) -> None:
        for field, value in vars(self).items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"SyncTimeouts.{field}={value!r} must be a finite number of seconds > 0")


@dataclass(frozen=True)
class ProbeCheck:
    """Post-sync verification: engine prompt logprobs vs the trainer's for the new weights.

    `trainer_logprobs(sequences)` returns, per sequence, logprob of token i given tokens < i for i >= 1 (the
    same convention as `RolloutEngine.score`). Parity tolerance: 1e-4 for fp32 engines; bf16 needs more."""

    sequences: Sequence[Sequence[int]]
    trainer_logprobs: Callable[[list[list[int]]], list[list[float]]]
    tolerance: float = 1e-4

    def __post_init__(self) -> None:
        if not self.sequences or any(len(s) < 2 for s in self.sequences):
            raise ValueError("ProbeCheck.sequences must be non-empty, each with >= 2 tokens")
        if not self.tolerance > 0:
            raise ValueError(f"ProbeCheck.tolerance={self.tolerance} must be > 0")


@dataclass
class SyncReport:
    """What one sync moved and how fast (seconds: begin .. finalize, i.e. transfer + engine loads)."""

    version: int
    bytes: int
    buckets: int
    seconds: float
    gbps: float
    verified: bool
    max_abs_logprob_diff: float | None


def max_abs_diff(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    """Largest |a - b| over matching sequences; a length mismatch is an error, not a silent truncation."""
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        raise WeightSyncError(f"logprob shapes differ: {[len(x) for x in a]} vs {[len(y) for y in b]}")
    return max((abs(float(x) - float(y)) for xs, ys in zip(a, b) for x, y in zip(xs, ys)), default=0.0)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class WeightSyncManager:
    """Runs versioned syncs through `transport` into the engines it serves.

    `engines` (optional, any order) are the `RolloutEngine` views of the same engines, used to pause them,
    check the served version and verify. `initial_version` is the version the engines serve now."""

    def __init__(self, transport: WeightTransport, engines: Sequence[RolloutEngine] = (),
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, verify: ProbeCheck | None = None,
                 timeouts: SyncTimeouts = SyncTimeouts(), initial_version: int = 0,
                 progress: Callable[[str], None] | None = _stderr, progress_every_s: float = 5.0) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.transport = transport
        self.engines = list(engines)
        self.bucket_bytes = bucket_bytes
        self.verify = verify
        self.timeouts = timeouts
        self.version = initial_version
        self.progress = progress  # None: silent; otherwise a line per `progress_every_s` and one at the end
        self.progress_every_s = progress_every_s
        self.unhealthy: dict[str, str] = {}  # engine-level failures found after finalize (version, verify)

    def _engine_label(self, i: int) -> str:
        return getattr(self.engines[i], "name", None) or f"engine {i}"

    def _say(self, msg: str) -> None:
        if self.progress is not None:
            self.progress(msg)

    def sync(self, export: Iterable[NamedTensors], total_bytes: int | None = None) -> SyncReport:
        """Push one full export (an iterable of (name, tensor) lists) as version `self.version + 1`.

        `total_bytes` (optional) only makes the progress lines say 'bucket i/N'."""
        if self.unhealthy:
            raise WeightSyncError(f"refusing to sync: engines failed an earlier sync and must be restarted: "
                                  f"{self.unhealthy}")
        new_version = self.version + 1
        buckets = bucketize(export, self.bucket_bytes)
        first = next(buckets)  # an empty export raises here, before any engine is touched
        self.transport.connect(self.timeouts.connect)
        if self.engines:
            pause = [(self._engine_label(i), (lambda e=e: e.abort_all(self.timeouts.call)))
                     for i, e in enumerate(self.engines)]
            run_concurrently("abort_all (pause)", pause, self.timeouts.call)
        est = math.ceil(total_bytes / self.bucket_bytes) if total_bytes else None
        nbytes = count = 0
        t0 = last_said = time.perf_counter()
        self.transport.begin(new_version, self.timeouts.call)
        try:
            for bucket in itertools.chain([first], buckets):
                self.transport.send_bucket(bucket, self.timeouts.bucket)
                count += 1
                nbytes += bucket.nbytes
                now = time.perf_counter()
                if count == 1 or now - last_said >= self.progress_every_s:  # a 500B sync has ~2000 buckets
                    last_said = now
                    self._say(f"[weight sync v{new_version}] bucket {count}{f'/~{est}' if est else ''}: "
                              f"{nbytes / 2**30:.3f} GiB sent, {now - t0:.1f} s")
            self.transport.finalize(self.timeouts.call)
        except BaseException as exc:
            self.transport.abort(f"{type(exc).__name__}: {exc}")
            raise
        seconds = time.perf_counter() - t0
        self._check_versions(new_version)
        diff = self._verify() if self.verify is not None else None
        self.version = new_version
        report = SyncReport(version=new_version, bytes=nbytes, buckets=count, seconds=seconds,
                            gbps=nbytes / max(seconds, 1e-12) / 1e9, verified=self.verify is not None,
                            max_abs_logprob_diff=diff)
        self._say(f"[weight sync v{new_version}] done: {nbytes / 2**30:.3f} GiB in {count} buckets, "
                  f"{seconds:.3f} s, {report.gbps:.2f} GB/s" + (f", verified (max |dlogprob| {diff:.2e})"
                                                                  if diff is not None else ""))
        return report

    def _check_versions(self, new_version: int) -> None:
        for i, engine in enumerate(self.engines):
            served = engine.weight_version
            if served != new_version:
                label = self._engine_label(i)
                self.unhealthy[label] = f"serves version {served} after a sync to {new_version}"
                raise WeightSyncError(f"{label}: serves weight version {served} after the sync to {new_version}")

    def _verify(self) -> float:
        assert self.verify is not None
        if not self.engines:
            raise WeightSyncError("verify needs the engines (RolloutEngine) to score the probe sequences")
        seqs = [list(map(int, s)) for s in self.verify.sequences]
        want = self.verify.trainer_logprobs(seqs)
        worst = 0.0
        for i, engine in enumerate(self.engines):
            label = self._engine_label(i)
            try:
                got = engine.score(seqs, self.verify_timeout)
            except Exception as exc:
                self.unhealthy[label] = f"scoring the probes after the sync failed: {exc}"
                raise WeightSyncError(f"{label}: post-sync verification could not score the probes: {exc}") from exc
            diff = max_abs_diff(got, want)
            if not diff <= self.verify.tolerance:  # NaN fails too
                self.unhealthy[label] = f"post-sync logprobs differ from the trainer's by {diff:.3e}"
                raise WeightSyncError(f"{label}: post-sync verification failed: max |engine - trainer| prompt "
                                      f"logprob = {diff:.3e} > tolerance {self.verify.tolerance:.1e}")
            worst = max(worst, diff)
        return worst

    @property
    def verify_timeout(self) -> float:
        return self.timeouts.verify

    def close(self) -> None:
        """Tear down the transport's channels (e.g. the update group)."""
        self.transport.close()

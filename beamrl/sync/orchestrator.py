"""The one weight-sync orchestrator: pause -> begin -> buckets -> finalize -> version -> verify -> resume.

`WeightSync` is what training (every trainer rank, through `beamrl.loop.weight_sync`), `beamrl bench sync` and
`benchmarks/sync_h200.py` run. One `sync(source)`:

1. **plan** (every rank): the export's layout -> buckets (`plan_buckets`, cached per layout); the manifest.
2. **pause** the engines (`abort_all`; running requests come back with finish_reason 'abort' and are resubmitted
   by the RL loop), and on colocated GPUs resume their weight memory (`staged_memory`). Engines that run calls in
   issue order (the Ray and pipe proxies) get `begin` right behind the pause, without a round trip between them.
3. **begin**: the manifest goes to every engine, which refuses a stale version or a layout that does not match
   its weights before anything is applied. Behind a proxy the pause and `begin` are answered while the first
   bucket is exported and packed; both answers are taken before it is sent (`_ship`, the transport's `send`).
4. **buckets**: the export streams (a collective on a multi-rank trainer: every rank iterates it); on the shipping
   rank each completed bucket is packed once (`pack_bucket`) into the buffer the transport gives and sent. Sends
   are pipelined: the next bucket is packed while the engines load this one. With `rank_slots` (colocated buckets
   from every trainer rank, `beamrl.sync.rank_slots`) every rank follows the buckets in lockstep and each packed
   bucket is spread to every rank's slot before it is sent; after a failure the shipping rank still completes
   every spread, as it completes the export.
5. **agree** (`source.finish`): every trainer rank learns whether the export shipped, so a failure on the shipping
   rank never leaves the other ranks waiting in a collective.
6. **finalize**: every engine commits (checks every bucket arrived with intact bytes) and serves the new version.
7. **version**: every engine must report it (a proxy reads it right behind its commit, in the same round trip:
   `served_version_after_commit`).
8. **verify** (the first sync, then every `probe.every`-th): every engine scores the probe sequences; the largest
   |engine - trainer| logprob must be within `probe.tolerance`, and the mean within `probe.mean_tolerance` when set
   (the trainer's side, `source.logprobs`, is a collective too).
9. **resume**: colocated GPUs take back their KV cache and CUDA graphs.

Any failure aborts the session: each engine rolls back or stops serving (`abort_weight_update`), the orchestrator
raises `WeightSyncError`, and an engine left unhealthy is refused until restarted. `sync(source, engines=[e])`
syncs a subset (e.g. one restarted engine) through a transport of its own, with the current version.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from beamrl.protocols.weights import WeightReceiver, WeightSyncError
from beamrl.sync.calls import bounded, run_concurrently, wait_replies
from beamrl.sync.export import ExportSource
from beamrl.sync.packing import pack_bucket
from beamrl.sync.plan import DEFAULT_BUCKET_BYTES, BucketPlan, plan_buckets
from beamrl.sync.rank_slots import RankSlots
from beamrl.sync.transports.base import WeightTransport

TransportFactory = Callable[[Sequence[WeightReceiver]], WeightTransport]


@dataclass(frozen=True)
class SyncTimeouts:
    """Seconds allowed for each kind of wait. Every engine call has one; none may be infinite."""

    connect: float = 300.0  # update-group rendezvous (engines join concurrently)
    call: float = 60.0  # begin/end session, version, pause, abort
    bucket: float = 300.0  # one bucket: transfer + load on every engine
    verify: float = 120.0  # scoring the probe sequences

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"SyncTimeouts.{name}={value!r} must be a finite number of seconds > 0")

    @classmethod
    def uniform(cls, seconds: float) -> "SyncTimeouts":
        return cls(connect=seconds, call=seconds, bucket=seconds, verify=seconds)


@dataclass(frozen=True)
class LogprobGap:
    """|engine - trainer| prompt logprobs over a probe's tokens: the largest and the mean."""

    max: float
    mean: float


@dataclass(frozen=True)
class ProbeCheck:
    """Post-sync check: engines' prompt logprobs on `sequences` vs the trainer's for the synced weights.

    `tolerance` bounds the largest |engine - trainer| over the probe's tokens: 1e-4 where both compute the same thing
    in float32 (exact). `mean_tolerance`, when set, bounds the mean too: the loose sanity alarm in bfloat16 (docs/
    weight-sync.md, "The probe check"), where a token whose router scores nearly tie may take other experts on one
    side and move its logprob (and the next ones') by up to ~1 nat with every weight right, while wrong weights move
    every token; its `tolerance` on the largest is then loose. `every`: run it on the first sync and then on every
    N-th (syncs 1, 1 + N, 1 + 2N, ...; a subset sync always); checksums run every sync."""

    sequences: Sequence[Sequence[int]]
    tolerance: float = 1e-4
    every: int = 1
    mean_tolerance: float | None = None

    def __post_init__(self) -> None:
        if not self.sequences or any(len(s) < 2 for s in self.sequences):
            raise ValueError("ProbeCheck.sequences must be non-empty, each with >= 2 tokens")
        if not self.tolerance >= 0:
            raise ValueError(f"ProbeCheck.tolerance={self.tolerance} must be >= 0")
        if self.every < 1:
            raise ValueError(f"ProbeCheck.every={self.every} must be >= 1")
        if self.mean_tolerance is not None and not 0 <= self.mean_tolerance <= self.tolerance:
            raise ValueError(f"ProbeCheck.mean_tolerance={self.mean_tolerance} must be in [0, tolerance="
                             f"{self.tolerance}] (a mean above its bound on the largest checks nothing)")


@dataclass
class SyncReport:
    """What one sync moved and how fast (`seconds`: begin .. finalize, i.e. transfer + engine loads, pipelined).
    `code_path`: the orchestrator class and packing function that ran (the same for training and the benches);
    `transport_mode`: how the transport moved the buckets (e.g. the colocated transport's 'staged', 'per_rank')."""

    version: int
    bytes: int
    buckets: int
    seconds: float
    gbps: float
    engines: list[str]
    verified: bool
    max_abs_logprob_diff: float | None
    code_path: str = ""
    transport_mode: str = ""
    times: dict[str, float] = field(default_factory=dict)
    mean_abs_logprob_diff: float | None = None


def logprob_gap(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> LogprobGap:
    """Largest and mean |a - b| over matching sequences; a length mismatch is an error, not a silent truncation
    (NaN propagates to both, and fails every tolerance)."""
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        raise WeightSyncError(f"logprob shapes differ: {[len(x) for x in a]} vs {[len(y) for y in b]}")
    gaps = [abs(float(x) - float(y)) for xs, ys in zip(a, b) for x, y in zip(xs, ys)]
    if not gaps:
        return LogprobGap(0.0, 0.0)
    worst = float("nan") if any(g != g for g in gaps) else max(gaps)
    return LogprobGap(worst, sum(gaps) / len(gaps))


class _CountedUnits:
    """A stream that counts the units taken from it (where `BucketPlan.completions` resumes after a failure)."""

    def __init__(self, stream) -> None:
        self._it, self.units = iter(stream), 0

    def __iter__(self):
        return self

    def __next__(self):
        unit = next(self._it)
        self.units += 1
        return unit


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _qualname(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


class WeightSync:
    """Runs versioned, verified syncs (module docstring).

    `transport`: a `WeightTransport`, or a factory `receivers -> WeightTransport` (needed to sync a subset of the
    engines), or None on a trainer rank that does not ship (it still takes part in the collective export and probe
    pass). `engines`: the receivers, which also answer `abort_all`, `score`, `served_weight_version` and (colocated
    GPUs, `staged_memory`) `resume_memory`. `initial_version`: the version the engines serve now.
    `resume_after_sync`: the memory tags a staged sync resumes at its end (default KV cache and CUDA graphs).
    `rank_slots`: this rank's `RankSlots`, on every trainer rank, when the colocated engines take their buckets from
    every trainer rank (the shipping rank's transport holds the same object)."""

    def __init__(self, transport: WeightTransport | TransportFactory | None, engines: Sequence[WeightReceiver] = (),
                 *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeouts: SyncTimeouts = SyncTimeouts(),
                 initial_version: int = 0, probe: ProbeCheck | None = None, staged_memory: bool = False,
                 resume_after_sync: Sequence[str] = ("kv_cache", "cuda_graph"),
                 progress: Callable[[str], None] | None = _stderr, progress_every_s: float = 5.0,
                 rank_slots: RankSlots | None = None) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self._factory: TransportFactory | None = None
        self._transport: WeightTransport | None = None
        if isinstance(transport, WeightTransport):
            self._transport = transport
        elif transport is not None:
            self._factory = transport
        self.engines = list(engines)
        if self.ships and not self.engines and self._transport is None:
            raise ValueError("a shipping WeightSync needs its engines to build the transport")
        self.bucket_bytes = bucket_bytes
        self.timeouts = timeouts
        self.version = initial_version
        self.probe = probe
        self.staged_memory = staged_memory
        # What the engines take back at the end of a staged sync; () when the caller resumes it later (a colocated
        # trainer that first goes to sleep: beamrl.loop.colocated).
        self.resume_after_sync = tuple(resume_after_sync)
        # None: silent. Otherwise, for long work only: a line every `progress_every_s` while buckets ship, and a
        # summary of the first sync and of every sync that took at least `progress_every_s` (the RL loop's console
        # line already shows each step's sync time).
        self.progress = progress
        self.progress_every_s = progress_every_s
        self._summarised = False  # whether a sync's summary line was said (the first one always is)
        self.pack = pack_bucket  # the one packing function (reported in `SyncReport.code_path`)
        self.rank_slots = rank_slots
        self.unhealthy: dict[str, str] = {}  # engine failures found after commit (version, verification)
        self.syncs = 0
        self._plans: dict[object, BucketPlan] = {}

    @property
    def ships(self) -> bool:
        return self._transport is not None or self._factory is not None

    @property
    def code_path(self) -> str:
        return f"{_qualname(type(self))} + {_qualname(self.pack)}"

    @property
    def transport(self) -> WeightTransport | None:
        if self._transport is None and self._factory is not None:
            self._transport = self._factory(self.engines)
        return self._transport

    def _say(self, msg: str) -> None:
        if self.progress is not None:
            self.progress(msg)

    def plan(self, source: ExportSource) -> BucketPlan:
        key = (source.layout_key, self.bucket_bytes)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 8:
                self._plans.clear()
            plan = self._plans[key] = plan_buckets(source.units(), self.bucket_bytes)
        return plan

    @staticmethod
    def _label(engine: WeightReceiver, i: int) -> str:
        return getattr(engine, "name", None) or f"engine {i}"

    def _each(self, what: str, engines: Sequence[WeightReceiver], call: Callable[[WeightReceiver], object],
              timeout: float) -> None:
        run_concurrently(what, [(self._label(e, i), (lambda e=e: call(e))) for i, e in enumerate(engines)], timeout,
                         bounded_calls=bounded(engines))

    def _require_healthy(self, transport: WeightTransport, targets: Sequence[WeightReceiver]) -> None:
        """Refuse a sync to an engine marked by an earlier failed sync (only the targets': a stopped engine's mark
        must not block the sync of the others)."""
        labels = {self._label(e, self.engines.index(e) if e in self.engines else i) for i, e in enumerate(targets)}
        bad = {k: v for k, v in {**getattr(transport, "unhealthy", {}), **self.unhealthy}.items() if k in labels}
        if bad:
            detail = "; ".join(f"{k}: {v}" for k, v in bad.items())
            raise WeightSyncError(f"refusing to sync: engine(s) failed an earlier sync and must be restarted first "
                                  f"({detail})")

    def mark_unhealthy(self, engine: str, reason: str) -> None:
        self.unhealthy.setdefault(engine, reason)

    def replace_engine(self, index: int, receiver: WeightReceiver) -> None:
        """A restarted engine takes engine `index`'s place: the old one's failure marks are dropped, and the
        transport (built for the old receivers, e.g. an update group the dead engine was in) is closed, so the next
        full sync builds it again for the current engines. Bring the new engine to the current version with
        `sync(source, engines=[receiver])` before that."""
        self.unhealthy.pop(self._label(self.engines[index], index), None)
        self.engines[index] = receiver
        if self._factory is not None and self._transport is not None:
            transport, self._transport = self._transport, None
            try:
                transport.close()
            except Exception as exc:  # noqa: BLE001 - the dead engine cannot answer its part of the teardown
                self._say(f"[weight sync] closing the transport of the replaced engine {self._label(receiver, index)}: "
                          f"{type(exc).__name__}: {exc}")

    # ----------------------------------------------------------------------------------------------- the steps
    def _prepare(self, transport: WeightTransport, targets: Sequence[WeightReceiver]) -> list[tuple[str, list]]:
        """Connect, pause the engines and (colocated GPUs) resume their weight memory. Where every engine runs
        calls in issue order (`calls_in_issue_order`: the Ray and pipe proxies) the pause is only issued: the
        session's `begin` goes out behind it at once, and `_settle` checks the replies afterwards (one round trip
        instead of two). Returns the calls to settle (what, [(engine, pending call)]); [] when all were waited for."""
        self._require_healthy(transport, targets)
        transport.connect(self.timeouts.connect)
        if not targets:
            return []
        steps = [("abort_all (pause)", "abort_all", ())]
        if self.staged_memory:
            steps.append(("resume_memory(weights)", "resume_memory", (["weights"],)))
        if not all(e.calls_in_issue_order for e in targets):
            for what, method, args in steps:
                self._each(what, targets, lambda e: getattr(e, method)(*args, self.timeouts.call), self.timeouts.call)
            return []
        return [(what, [(self._label(e, i), e.call_async(method, self.timeouts.call, *args))
                        for i, e in enumerate(targets)]) for what, method, args in steps]

    def _settle(self, issued: list[tuple[str, list]]) -> None:
        """Wait for the replies of calls `_prepare` issued; the first step with a failure raises
        `ReceiverCallError` naming every engine that failed it."""
        deadline = time.monotonic() + self.timeouts.call
        for what, calls in issued:
            wait_replies(what, calls, deadline)

    def _ship(self, plan: BucketPlan, stream, transport: WeightTransport, version: int, t_begin: float,
              issued: list[tuple[str, list]]) -> tuple[int, int]:
        """Pack each completed bucket once into the transport's buffer and send it; returns (buckets, bytes).
        `issued`: the pause calls `_prepare` did not wait for. They (and, in the transport, `begin`) are answered
        while the first bucket is exported and packed, and waited for before it is sent; a failed pause is the
        failure reported, also when the export failed first."""
        count = nbytes = 0
        last_said = time.perf_counter()
        try:
            for k, tensors in plan.assemble(stream):
                layout = plan.buckets[k]
                target = transport.buffer(layout, self.timeouts.bucket)
                self.pack(target.buffer, layout, tensors, target.views, target.checksum)
                del tensors
                if issued:
                    pending, issued = issued, []  # settled once, also when it raises (not again in finally)
                    self._settle(pending)
                transport.send(layout, self.timeouts.bucket)
                count += 1
                nbytes += layout.nbytes
                last_said = self._progress(version, count, len(plan.buckets), nbytes, t_begin, last_said)
        finally:
            if issued:  # failed before the first send
                self._settle(issued)
        return count, nbytes

    def _progress(self, version: int, count: int, total: int, nbytes: int, t_begin: float, last_said: float) -> float:
        """A bucket line if `progress_every_s` passed since the last one (long syncs only: a 500B sync has ~2000
        buckets); returns when the last line was said."""
        now = time.perf_counter()
        if now - last_said < self.progress_every_s:
            return last_said
        self._say(f"[weight sync v{version}] bucket {count}/{total}: {nbytes / 2**30:.3f} GiB sent, "
                  f"{now - t_begin:.1f} s")
        return now

    def _ship_per_rank(self, plan: BucketPlan, stream, transport: WeightTransport | None,
                       failure: BaseException | None, version: int,
                       t_begin: float) -> tuple[int, int, BaseException | None]:
        """Every rank, in lockstep with the export: the shipping rank packs bucket k into its rank slot, every
        rank takes part in spreading it (`RankSlots.spread`), then the shipping rank sends it. A failure on the
        shipping rank stops packing and sending, never the spreads (the other ranks are in them)."""
        count = nbytes = spread = 0
        counted = _CountedUnits(stream)
        last_said = time.perf_counter()
        if self.ships and failure is None:
            try:
                for k, tensors in plan.assemble(counted):
                    layout = plan.buckets[k]
                    if failure is None:
                        try:
                            target = transport.buffer(layout, self.timeouts.bucket)
                            self.pack(target.buffer, layout, tensors, target.views, target.checksum)
                        except Exception as exc:
                            failure = exc
                    del tensors
                    self.rank_slots.spread(layout)
                    spread += 1
                    if failure is None:
                        try:
                            transport.send(layout, self.timeouts.bucket)
                        except Exception as exc:
                            failure = exc
                            continue
                        count += 1
                        nbytes += layout.nbytes
                        last_said = self._progress(version, count, len(plan.buckets), nbytes, t_begin, last_said)
            except Exception as exc:  # the export did not match its layout: the rest of it is only followed
                failure = exc
        for k in plan.completions(counted, counted.units, spread):
            self.rank_slots.spread(plan.buckets[k])
        return count, nbytes, failure

    # ----------------------------------------------------------------------------------------------- the sync
    def sync(self, source: ExportSource, *, engines: Sequence[WeightReceiver] | None = None,
             version: int | None = None) -> SyncReport | None:
        """Push `source` to every engine (or to `engines`, a subset, with the current version) as one session.
        Every trainer rank calls it; the shipping rank returns the `SyncReport`, the others None."""
        subset = engines is not None
        if subset and self._factory is None and self.ships:
            raise ValueError("syncing a subset of the engines needs a transport factory, not a transport instance")
        targets = list(engines) if subset else self.engines
        new_version = version if version is not None else (self.version if subset else self.version + 1)
        plan = self.plan(source)
        self.syncs += 1
        # The first sync is always verified (a wrong layout or mapping shows at once), then every `probe.every`-th.
        probe_due = self.probe is not None and (subset or (self.syncs - 1) % self.probe.every == 0)
        transport = None
        failure: BaseException | None = None
        t_begin = time.perf_counter()
        times: dict[str, float] = {}
        count = nbytes = 0
        if self.rank_slots is not None:  # collective: before anything can fail on one rank only
            self.rank_slots.ensure(plan.max_bucket_bytes)
        stream = source.stream()
        if self.ships:
            try:
                transport = self._factory(targets) if subset else self.transport
                t_prepare = time.perf_counter()
                issued = self._prepare(transport, targets)
                t_begin = time.perf_counter()
                times["prepare_s"] = t_begin - t_prepare
                try:
                    transport.begin(plan.manifest(new_version, source.mode), self.timeouts.call)
                except BaseException:  # the pause went out first: its failure is the one to report
                    self._settle(issued)
                    raise
                if self.rank_slots is None:
                    count, nbytes = self._ship(plan, stream, transport, new_version, t_begin, issued)
                else:
                    self._settle(issued)
            except Exception as exc:
                failure = exc
        if self.rank_slots is not None:
            count, nbytes, failure = self._ship_per_rank(plan, stream, transport, failure, new_version,
                                                         t_begin)
        for _ in stream:  # the export is collective: finish it whatever happened here
            pass
        ok = source.finish(failure is None)
        if self.ships and (failure is not None or not ok):
            reason = (f"{type(failure).__name__}: {failure}" if failure is not None
                      else "another trainer rank failed its part of the export")
            if transport is not None:
                transport.abort(reason, self.timeouts.call)
                if subset:
                    transport.close()
            raise WeightSyncError(f"weight sync to version {new_version} failed: {reason}") from failure
        if not ok:
            raise WeightSyncError(f"weight sync to version {new_version} failed on the shipping trainer rank")
        commit_error: Exception | None = None
        seconds = 0.0
        if self.ships:
            try:
                transport.finalize(self.timeouts.call)
                seconds = time.perf_counter() - t_begin
            except Exception as exc:  # a bucket refused late (pipelined) or a refused commit: abort the session
                commit_error = WeightSyncError(f"weight sync to version {new_version} failed: "
                                               f"{type(exc).__name__}: {exc}")
                commit_error.__cause__ = exc
                transport.abort(str(exc), self.timeouts.call)
            if subset:
                transport.close()
        # Per-rank buckets: every rank's slots stay untouched until the engines copied them (the shipping rank's
        # commit); this also tells every rank whether the commit went through.
        committed = self.rank_slots.agree(commit_error is None) if self.rank_slots is not None else True
        reference = source.logprobs([list(map(int, s)) for s in self.probe.sequences]) if probe_due else None
        if not self.ships:
            if not committed:
                raise WeightSyncError(f"weight sync to version {new_version} failed at the commit on the shipping "
                                      f"trainer rank")
            if not subset:
                self.version = new_version
            return None
        if commit_error is not None:
            raise commit_error
        self._check_versions(targets, new_version)
        gap = self._verify(targets, reference) if reference is not None else None
        if self.staged_memory and targets and self.resume_after_sync:
            tags = list(self.resume_after_sync)
            self._each(f"resume_memory({', '.join(tags)})", targets,
                       lambda e: e.resume_memory(tags, self.timeouts.call), self.timeouts.call)
        if not subset:
            self.version = new_version
        report = SyncReport(version=new_version, bytes=nbytes, buckets=count, seconds=seconds,
                            gbps=nbytes / max(seconds, 1e-12) / 1e9,
                            engines=[self._label(e, i) for i, e in enumerate(targets)],
                            verified=gap is not None, max_abs_logprob_diff=gap.max if gap else None,
                            code_path=self.code_path,
                            transport_mode=str(getattr(transport, "mode", None) or transport.name),
                            times=times, mean_abs_logprob_diff=gap.mean if gap else None)
        if seconds >= self.progress_every_s or not self._summarised:  # the first sync, then only long ones
            self._summarised = True
            self._say(f"[weight sync v{new_version}] done: {nbytes / 2**30:.3f} GiB in {count} buckets, {seconds:.3f} s, "
                      f"{report.gbps:.2f} GB/s, {transport.content_check}" +
                      (f", probe |dlogprob| max {gap.max:.2e} <= {self.probe.tolerance:g}, mean {gap.mean:.2e}" +
                       (f" <= {self.probe.mean_tolerance:g}" if self.probe.mean_tolerance is not None else "")
                       if gap is not None else ""))
        return report

    def _check_versions(self, engines: Sequence[WeightReceiver], new_version: int) -> None:
        served: dict[str, int] = {}

        def read(label: str, e: WeightReceiver) -> None:
            served[label] = e.served_version_after_commit(self.timeouts.call)

        labels = [self._label(e, i) for i, e in enumerate(engines)]
        run_concurrently("served_weight_version", [(lb, (lambda lb=lb, e=e: read(lb, e)))
                                                   for lb, e in zip(labels, engines)], self.timeouts.call,
                         bounded_calls=bounded(engines))
        for label in labels:
            if served[label] != new_version:
                self.mark_unhealthy(label, f"serves version {served[label]} after a sync to {new_version}")
                raise WeightSyncError(f"{label}: serves weight version {served[label]} after the sync to "
                                      f"{new_version}")

    def _verify(self, engines: Sequence[WeightReceiver], reference: list[list[float]]) -> LogprobGap:
        seqs = [list(map(int, s)) for s in self.probe.sequences]
        scores: dict[str, list[list[float]]] = {}

        def score(label: str, e: WeightReceiver) -> None:
            scores[label] = e.score(seqs, self.timeouts.verify)

        labels = [self._label(e, i) for i, e in enumerate(engines)]
        try:
            run_concurrently("score (post-sync probe)", [(lb, (lambda lb=lb, e=e: score(lb, e)))
                                                         for lb, e in zip(labels, engines)], self.timeouts.verify,
                             bounded_calls=bounded(engines))
        except WeightSyncError as exc:
            for lb in labels:
                if lb not in scores:
                    self.mark_unhealthy(lb, f"scoring the probes after the sync failed: {exc}")
            raise WeightSyncError(f"post-sync verification could not score the probes: {exc}") from exc
        worst = LogprobGap(0.0, 0.0)
        for label in labels:  # every engine is checked: one bad replica cannot hide behind another
            gap = logprob_gap(scores[label], reference)
            checks = [("max", gap.max, self.probe.tolerance)]
            if self.probe.mean_tolerance is not None:
                checks.append(("mean", gap.mean, self.probe.mean_tolerance))
            for name, value, bound in checks:
                if not value <= bound:  # NaN fails too
                    self.mark_unhealthy(label, f"post-sync logprobs differ from the trainer's by {value:.3e} ({name})")
                    raise WeightSyncError(f"{label}: post-sync verification failed: {name} |engine - trainer| prompt "
                                          f"logprob = {value:.3e} > tolerance {bound:.1e} (max {gap.max:.3e}, mean "
                                          f"{gap.mean:.3e} over the probe's tokens)")
            worst = LogprobGap(max(worst.max, gap.max), max(worst.mean, gap.mean))
        return worst

    def release_buffers(self) -> None:
        """Free the transport's staging buffers until the next sync (a colocated trainer going to sleep); with
        `rank_slots`, this rank's slots too (every rank calls it)."""
        if self._transport is not None:
            self._transport.release_buffers(self.timeouts.call)
        if self.rank_slots is not None:
            self.rank_slots.release()

    def discard_buffers(self) -> None:
        """The run is ending: free the transport's staging buffers and this rank's slots without engine calls (each
        rank on its own; `WeightTransport.discard_buffers`)."""
        if self._transport is not None:
            self._transport.discard_buffers()
        if self.rank_slots is not None:
            self.rank_slots.release()

    def close(self) -> None:
        """Tear down the transport's channels (e.g. the update group), its staging buffers and this rank's slots."""
        if self._transport is not None:
            self._transport.close()
        if self.rank_slots is not None:
            self.rank_slots.release()

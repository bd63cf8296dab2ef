"""The driver's handles on actor groups: the SPMD trainer ranks and the rollout engines."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError

import ray

from beamrl.cluster.placement import sync_rank_offsets
from beamrl.loop.actor_calls import DIED, FAILED, abandon, call_result, fetch, wait_all, wait_any
from beamrl.loop.actors import EngineActor, TrainerActor, TrainerRankSpec
from beamrl.loop.express import ExpressAddress, ExpressClient, ExpressPeerLost
from beamrl.loop.log import log
from beamrl.loop.ray_utils import ActorCallError, ray_get
from beamrl.loop.wire import Wire
from beamrl.protocols.rollout import EngineError, GenerateRequest, GenerateResult
from beamrl.rollout.router import EngineRouter
from beamrl.sync import shm

#: After one trainer rank's call failed, how long the others get to report a dead rank (the usual root cause of a
#: failed collective on a live rank), so the message names the rank that died.
RANK_DEATH_GRACE_S = 10.0


def shutdown_actors(actors: list, names: list[str], together: bool = False, timeout_s: float = 30.0) -> None:
    """Ask each actor to release its resources (`timeout_s` each, one after another; `together`: all asked at once,
    `timeout_s` for all, for peers that may be stuck alike, such as trainer ranks left in a collective), then kill
    it; best effort at teardown. A shutdown that failed is said: what the actor started (an SGLang server's
    process group) may outlive it."""
    def said(n: str, exc: BaseException) -> None:
        log(f"{n}: its shutdown did not complete ({first_line(exc)}); killing the actor: processes it started may "
            "outlive it")

    asked = [a.shutdown.remote() for a in actors] if together else None
    deadline = time.monotonic() + timeout_s
    for i, (a, n) in enumerate(zip(actors, names)):
        try:
            ref = asked[i] if together else a.shutdown.remote()
            ray_get(ref, max(0.1, deadline - time.monotonic()) if together else timeout_s, f"{n}.shutdown")
        except Exception as exc:  # noqa: BLE001 - the actor is killed next anyway
            said(n, exc)
        try:
            ray.kill(a)
        except Exception:  # noqa: BLE001 - Ray itself may already be gone
            pass


def _sync_wait(request) -> float:
    """How long the driver waits for a sync's call: pause, begin, the buckets, commit and the probe each have their
    own limit (`request.timeout`)."""
    return request.timeout * 4 + 60


@dataclass(frozen=True)
class CarriedSync:
    """The outcome of a sync that ran at the end of a train step's call (`TrainerGroup.train_step_then_sync`):
    rank 0's report, or the failure a separate `sync_weights` call would have raised."""

    report_dict: dict | None
    error: ActorCallError | None

    def report(self) -> dict:
        """Rank 0's sync report; raises the sync's `ActorCallError` if it failed."""
        if self.error is not None:
            raise self.error
        return self.report_dict


class TrainerRankError(ActorCallError):
    """A trainer rank died (or gave no answer within its limit) during a call; names the rank and where it ran."""

    def __init__(self, message: str, rank: int, label: str):
        super().__init__(message)
        self.rank, self.label = rank, label


def _opened(wire: Wire, what: str):
    """A call's `Wire` result, opened; a result that cannot be unpickled (e.g. a driver and an engine on different
    code) raises naming the call."""
    try:
        return wire.open()
    except Exception as e:  # noqa: BLE001 - re-raised with the call's name
        raise EngineError(f"{what}: its result could not be unpickled: {type(e).__name__}: {e}") from e


def first_line(err: BaseException) -> str:
    """`err`'s message on one line: its first line, spaces collapsed (Ray's notices run to many), or its type."""
    text = str(err).strip()
    return " ".join(text.splitlines()[0].split()) if text else type(err).__name__


class TrainerGroup:
    """All Megatron ranks of the policy. Every call goes to every rank (SPMD); rank 0's answer is returned.

    A rank that dies ends the call at once (not at its timeout: the live ranks may be blocked in a collective with
    it) with a `TrainerRankError` naming the rank and `labels[rank]` (its placement, e.g. node and GPU)."""

    def __init__(self, setup, hf_checkpoint: str, world_size: int, timeout: float,
                 actor_options: list[dict], num_threads: int = 1, labels: list[str] | None = None):
        self.timeout = timeout
        self.labels = labels or [f"rank {r}" for r in range(world_size)]
        self.actors = [TrainerActor.options(**actor_options[r]).remote(num_threads=num_threads)
                       for r in range(world_size)]
        addr, port = ray_get(self.actors[0].rendezvous_address.remote(), timeout, "trainer rank 0 address")
        ray_get([a.start.remote(spec=TrainerRankSpec(r, world_size, addr, port, num_threads), setup=setup,
                                hf_checkpoint=hf_checkpoint) for r, a in enumerate(self.actors)],
                timeout, "trainer start-up (building Megatron ranks)")
        dp = ray_get([a.data_parallel_rank.remote() for a in self.actors], timeout, "trainer.data_parallel_rank")
        self.dp_ranks = [d for d, _ in dp]
        self.dp_size = dp[0][1]
        self.process_ids = self.pids()
        self.express: list[ExpressClient] | None = None  # set by `open_express` (every actor on this node)

    def use_express(self, clients: list[ExpressClient]) -> None:
        """Send the per-step calls through these channels (one per rank, `open_express`)."""
        self.express = clients

    def express_addresses(self) -> list[ExpressAddress]:
        """Each rank's express server (opened on first ask)."""
        return self._gather([a.open_express.remote() for a in self.actors], self.timeout, "trainer.open_express")

    def _call(self, rank: int, method: str, *args, **kwargs):
        """`method` on rank `rank`: an express call when the run has them, else a Ray call."""
        if self.express is not None:
            return self.express[rank].call_async(method, *args, **kwargs)
        return getattr(self.actors[rank], method).remote(*args, **kwargs)

    def _all(self, what: str, timeout: float | None, fn):
        return self._gather([fn(a) for a in self.actors], timeout or self.timeout, f"trainer.{what}")

    def _gather(self, refs: list, timeout: float, what: str) -> list:
        """Every rank's answer, in rank order; the first failure raises at once (`TrainerRankError`), preferring a
        rank whose process died over a live rank whose collective broke because of it."""
        pending = {ref: r for r, ref in enumerate(refs)}
        out: list = [None] * len(refs)
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            ready = wait_any(list(pending), max(left, 0.0)) if left > 0 else []
            if not ready:
                ranks = sorted(pending.values())
                _abandon_all(pending)
                raise TrainerRankError(f"{what}: trainer rank(s) {', '.join(self._name(r) for r in ranks)} gave no "
                                       f"answer within {timeout:.0f} s", ranks[0], self.labels[ranks[0]])
            for ref in ready:
                r = pending.pop(ref)
                try:
                    out[r] = fetch(ref)
                except DIED as e:
                    _abandon_all(pending)
                    raise self._rank_error(r, what, e, died=True) from None
                except FAILED as e:
                    error = self._dead_rank_among(pending, what) or self._rank_error(r, what, e, died=False)
                    _abandon_all(pending)
                    raise error from None
        return out

    def _name(self, rank: int) -> str:
        return f"{rank} ({self.labels[rank]})"

    def _rank_error(self, rank: int, what: str, err: BaseException, died: bool) -> ActorCallError:
        """A dead rank: `TrainerRankError` (the run cannot go on). A live rank's failed call (e.g. a refused weight
        sync): `ActorCallError` with its words, for the caller to handle."""
        if died:
            return TrainerRankError(f"trainer rank {self._name(rank)} died during {what}: {first_line(err)}", rank,
                                    self.labels[rank])
        cause = getattr(err, "cause", None) or err
        return ActorCallError(f"{what}: trainer rank {self._name(rank)}: {type(cause).__name__}: {cause}")

    def _dead_rank_among(self, pending: dict, what: str) -> ActorCallError | None:
        if not pending:
            return None
        ready = wait_all(list(pending), RANK_DEATH_GRACE_S)
        for ref in ready:
            try:
                fetch(ref)
            except DIED as e:
                return self._rank_error(pending[ref], what, e, died=True)
            except Exception:  # noqa: BLE001 - another live rank's failure: the first one is reported
                pass
        return None

    def pids(self) -> list[int]:
        """Each rank's OS process id (logged at start-up)."""
        return self._gather([a.pid.remote() for a in self.actors], self.timeout, "trainer.pid")

    def kill(self) -> None:
        """End every rank now, without the polite shutdown (live ranks may be blocked in a collective with a dead
        one; asking them first would wait out each call's limit)."""
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.actors = []
        _close_all(self.express)
        self.express = None
        self._remove_left_files()

    def _remove_left_files(self) -> None:
        """Remove the CPU weight sync's shared-memory files that ranks killed without their shutdown left behind
        (`beamrl.sync.shm`; a rank's own shutdown removes them, a killed rank cannot). Only this machine's: CPU runs,
        the only ones that make such files, have every rank here. Best effort at teardown, said on the console."""
        try:
            removed = shm.remove_files_of_exited(self.process_ids)
        except OSError as e:  # e.g. a file of that name owned by another user
            log(f"trainer: could not remove the shared-memory files of ranks {self.process_ids}: {e}")
            return
        if removed:
            log(f"trainer: removed {len(removed)} shared-memory file(s) of killed ranks: {', '.join(removed)}")

    def compute_logprobs(self, batch, temperature: float, replay: bool, return_entropy: bool = False):
        return self._all("compute_logprobs", None, lambda a: a.compute_logprobs.remote(
            batch, temperature=temperature, return_entropy=return_entropy, replay=replay))[0]

    def _shares(self, micro_batches) -> list:
        if len(micro_batches) % self.dp_size:
            raise ValueError(f"{len(micro_batches)} micro-batches cannot be split evenly over {self.dp_size} "
                             f"data-parallel ranks")
        per = len(micro_batches) // self.dp_size
        return [micro_batches[d * per:(d + 1) * per] for d in range(self.dp_size)]

    def train_step(self, micro_batches, loss_fn, replay: bool, temperature: float = 1.0):
        """One optimizer step over the step's micro-batches: data-parallel rank d trains on the d-th contiguous
        share (ranks of one model-parallel group get the same share). The loss normaliser inside `loss_fn` is
        the whole step's, so the sum over DP ranks is the full-batch loss."""
        shares = self._shares(micro_batches)
        return self._gather([self._call(r, "train_step", Wire((shares[d], loss_fn)), replay=replay,
                                        temperature=temperature)
                             for r, d in enumerate(self.dp_ranks)], self.timeout, "trainer.train_step")[0]

    def train_step_then_sync(self, micro_batches, loss_fn, replay: bool, temperature: float,
                             engines: "EngineGroup", request) -> tuple:
        """`train_step`, then `sync_weights(engines, request)`, in one call to every rank (a round trip fewer).
        Returns (the step's result, `CarriedSync`): a failed sync does not raise here (the step happened); the
        caller handles `CarriedSync.report()`'s `ActorCallError` as that of a failed `sync_weights`."""
        shares = self._shares(micro_batches)
        out = self._gather([self._call(
            r, "train_step_then_sync", Wire((shares[d], loss_fn)), replay=replay, temperature=temperature,
            **engines.sync_arguments(request))
            for r, d in enumerate(self.dp_ranks)], self.timeout + _sync_wait(request),
            "trainer.train_step_then_sync")
        failed = next(((r, err) for r, (_, _, err) in enumerate(out) if err is not None), None)
        error = None if failed is None else ActorCallError(
            f"trainer.sync_weights: trainer rank {self._name(failed[0])}: {failed[1]}")  # as `sync_weights` says it
        return out[0][0], CarriedSync(out[0][1], error)

    # Checkpoint calls wait up to `timeout_s` inside the ranks; the actor call gets a minute more.
    def save_checkpoint(self, directory: str, async_save: bool, timeout_s: float) -> None:
        self._all("save_checkpoint", timeout_s + 60, lambda a: a.save_checkpoint.remote(directory=directory,
                                                                                async_save=async_save))

    def finalize_checkpoint(self, blocking: bool, timeout_s: float) -> str | None:
        return self._all("finalize_checkpoint", timeout_s + 60,
                         lambda a: a.finalize_checkpoint.remote(blocking=blocking, timeout_s=timeout_s))[0]

    def load_checkpoint(self, directory: str, timeout_s: float) -> None:
        self._all("load_checkpoint", timeout_s + 60, lambda a: a.load_checkpoint.remote(directory=directory))

    def sync_weights(self, engines: "EngineGroup", request) -> dict:
        """One weight sync, verification included (`beamrl.loop.weight_sync.SyncRequest`): every rank runs the
        orchestrator; rank 0's report is returned. A failure raises `ActorCallError` with the engine's words."""
        out = self._all("sync_weights", _sync_wait(request), lambda a: a.sync_weights.remote(
            **engines.sync_arguments(request)))
        return out[0]

    def save_lora_adapter(self, out_dir: str) -> str:
        """Write the trainer's LoRA adapter in PEFT format (docs/lora.md) into `out_dir`; returns it."""
        return self._all("save_lora_adapter", None, lambda a: a.save_lora_adapter.remote(out_dir=out_dir))[0]

    def sync_restarted(self, engines: "EngineGroup", index: int, request) -> dict:
        """Bring restarted engine `index` to `request.version` (a subset sync through the same orchestrator)."""
        return self._all("sync_restarted", _sync_wait(request), lambda a: a.sync_restarted.remote(
            receivers=engines.receivers, engine_names=engines.names, engine_tp=engines.tp_sizes, index=index,
            request=request))[0]

    def sleep(self, timeout: float) -> list[dict]:
        """Every rank releases its device state (colocated placement); one `SleepReport` dict per rank."""
        return self._all("sleep", timeout, lambda a: a.sleep.remote())

    def wake(self, timeout: float) -> list[dict]:
        """Every rank restores what `sleep` released; one `SleepReport` dict per rank."""
        return self._all("wake", timeout, lambda a: a.wake.remote())

    def export_hf_checkpoint(self, out_dir: str) -> str:
        return self._all("export_hf_checkpoint", None, lambda a: a.export_hf_checkpoint.remote(out_dir=out_dir))[0]

    def shutdown(self) -> None:
        _close_all(self.express)
        self.express = None
        # together: after a failed step the live ranks may sit in a collective with the failed one (30 s each,
        # one after another, was half an hour at 64 ranks)
        shutdown_actors(self.actors, [f"trainer-{r}" for r in range(len(self.actors))], together=True)
        self.actors = []
        self._remove_left_files()  # a rank whose shutdown failed or timed out


@dataclass
class PendingGenerate:
    """A rollout in flight (`EngineGroup.generate_async`): the flat requests, their group keys and sizes, the
    results so far, and the calls in flight (ref -> (engine, request positions, deadline))."""

    requests: list[GenerateRequest]
    keys: list[int]
    group_sizes: list[int]
    timeout: float
    results: list = field(default_factory=list)
    inflight: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.results = [None] * len(self.requests)


class EngineHandle:
    """Engine `index` of an `EngineGroup` as the router and the health monitor see an engine (`generate`,
    `health`, `shutdown`); it follows the engine across restarts (the group holds the current actors)."""

    def __init__(self, group: "EngineGroup", index: int):
        self.group, self.index = group, index

    @property
    def name(self) -> str:
        return self.group.names[self.index]

    def generate(self, requests: list[GenerateRequest], timeout: float) -> list[GenerateResult]:
        return _opened(call_result(self.group._generate_call(self.index, requests, timeout), timeout + 30,
                                   f"{self.name}.generate"), f"{self.name}.generate")

    def health(self, timeout: float) -> bool:
        """The group's check of this engine; a check that failed to answer raises its error, so the health
        monitor (which takes any raise as unhealthy) can say why."""
        ok = self.group.engine_health(self.index, timeout)
        error = self.group.health_errors.get(self.index)
        if error is not None:
            raise error
        return ok

    def shutdown(self) -> None:
        self.group.stop_engine(self.index)


class EngineGroup:
    """Rollout engines as actors: one `EngineActor` per node of each engine. All API traffic (generation, scoring,
    weight updates) goes to each engine's leader (node rank 0, `actors`); the other nodes (`followers`) are
    watched for liveness. Requests go through the router (`beamrl.rollout.router.EngineRouter`, one
    `EngineHandle` per engine): the requests of one prompt group go to one healthy engine (prefix-cache affinity).
    With `recovery` set (the RL loop's `beamrl.loop.engine_recovery.EngineRecovery`), an engine that fails or
    stops answering while a rollout waits on it is restarted and resynced, and its requests are re-issued
    unchanged (same seeds); without it, the failure raises `ActorCallError` naming the engine.

    Start-up has two phases: every node actor reserves its address and ports, then all nodes of every engine
    start together, each told the leader's meeting point (`dist_init_addr`). `engines[k]` lists engine k's node
    factories in node-rank order and `node_options[k]` their Ray options (their placement-group bundles)."""

    def __init__(self, engines: list[list], timeout: float, node_options: list[list[dict]], num_threads: int = 1):
        self.timeout, self.num_threads = timeout, num_threads
        self.factories, self.node_options = engines, node_options
        self.names = [nodes[0].name for nodes in engines]
        self.nodes: list[list] = [[] for _ in engines]
        self.recovery = None  # `EngineRecovery`, set by the RL loop
        # Calls left in flight on engines that failed: held until they end (their engine is shut down) and their
        # errors are read, never dropped unread (Ray reports a dropped call's error as unhandled, asynchronously).
        self._abandoned: list = []
        self.tp_sizes = [0] * len(engines)  # as each engine reports it once started
        self.health_errors: dict[int, Exception] = {}  # engine -> why its last health check raised
        # Per engine, its leader's express server and the driver's channel to it (None: stopped), once the run has
        # express calls (`open_express`: every actor on the driver's node); None without them.
        self.express: list[tuple[ExpressAddress, ExpressClient] | None] | None = None
        try:
            self._start(list(range(len(engines))))
        except BaseException:
            self.shutdown()  # the servers that did start must not outlive a failed start-up
            raise
        self.router = EngineRouter([EngineHandle(self, k) for k in range(len(engines))])

    @property
    def actors(self) -> list:
        """Each running engine's leader (node rank 0): every API call goes there (none once shut down). Not in
        engine order when an engine is stopped: `leaders` is."""
        return [nodes[0] for nodes in self.nodes if nodes]

    @property
    def leaders(self) -> list:
        """Engine k's leader at position k, None where engine k is stopped (lines up with `names`, `tp_sizes`)."""
        return [nodes[0] if nodes else None for nodes in self.nodes]

    @property
    def running(self) -> list[int]:
        """The indices of the engines that are not stopped."""
        return [k for k, nodes in enumerate(self.nodes) if nodes]

    def sync_arguments(self, request) -> dict:
        """The engines' side of a trainer sync call: receivers in engine order (None for a stopped engine) with
        their names and TP sizes, and `request` restricted to the running engines when one is stopped."""
        running = self.running
        if len(running) < len(self.nodes):
            request = dataclasses.replace(request, engines=tuple(running))
        return dict(receivers=self.receivers, engine_names=self.names, engine_tp=self.tp_sizes, request=request)

    @property
    def receivers(self) -> list:
        """What a trainer's weight sync reaches engine k through: its leader's express address when the run has
        express calls (every actor on one node), else the leader's actor handle; None for a stopped engine."""
        if self.express is None:
            return self.leaders
        return [x[0] if x is not None else None for x in self.express]

    def use_express(self, channels: dict[int, tuple[ExpressAddress, ExpressClient]]) -> None:
        """Send the rollout's calls, and give the trainer's syncs, these channels (engine -> (address, client),
        `open_express`); restarted engines get theirs as they start."""
        self.express = [channels.get(k) for k in range(len(self.nodes))]

    def express_address(self, k: int) -> ExpressAddress:
        """Engine k's leader's express server (opened on first ask)."""
        return ray_get(self.nodes[k][0].open_express.remote(), self.timeout, f"{self.names[k]}.open_express")

    def connect_express(self, k: int, address: ExpressAddress) -> None:
        """Call engine k's leader through `address` from now on (the run's express calls)."""
        self._close_express(k)
        self.express[k] = (address, ExpressClient(address, self.names[k]))

    def _close_express(self, k: int) -> None:
        if self.express is not None and self.express[k] is not None:
            self.express[k][1].close()
            self.express[k] = None

    def _generate_call(self, e: int, requests: list[GenerateRequest], timeout: float):
        if self.express is not None:
            return self.express[e][1].call_async("generate", Wire(requests), timeout=timeout)
        return self.nodes[e][0].generate.remote(Wire(requests), timeout=timeout)

    @property
    def followers(self) -> list[list]:
        """Each engine's other node processes (none for an engine on one node, or once shut down)."""
        return [nodes[1:] for nodes in self.nodes]

    def _start(self, indices: list[int]) -> None:
        """Start engines `indices` (all their nodes) in the two phases; a single engine can be started again
        alone after its actors were shut down."""
        for k in indices:
            self.nodes[k] = [EngineActor.options(**o).remote(factory=f, num_threads=self.num_threads)
                             for f, o in zip(self.factories[k], self.node_options[k])]
        every = [a for k in indices for a in self.nodes[k]]
        addresses = iter(ray_get([a.reserve.remote() for a in every], self.timeout, "rollout engines: reserving ports"))
        starts = []
        for k in indices:
            mine = [next(addresses) for _ in self.nodes[k]]
            leader_host, _, meet_port = mine[0]
            meet = f"{leader_host}:{meet_port}" if len(mine) > 1 else None
            starts += [a.start.remote(host=host, port=port, dist_init_addr=meet)
                       for a, (host, port, _) in zip(self.nodes[k], mine)]
        ray_get(starts, self.timeout, "rollout engine start-up")
        sizes = ray_get([self.nodes[k][0].tp_size.remote() for k in indices], self.timeout, "engines.tp_size")
        planned = [self.factories[k][0].rollout.engine_tp for k in indices]
        if sizes != planned:
            raise EngineError(f"engines report TP sizes {sizes}, the plan has {planned} (rollout.engine_tp)")
        for k, size in zip(indices, sizes):
            self.tp_sizes[k] = size
        if self.express is not None:  # a restart: the new leader's server, on this node as the run's express needs
            for k in indices:
                address = self.express_address(k)
                if address.node_id != ray.get_runtime_context().get_node_id():
                    raise EngineError(f"{self.names[k]} restarted on another node than the driver's; this run's "
                                      f"express calls need every actor on one node")
                self.connect_express(k, address)

    def restart_engine(self, k: int) -> None:
        """Start engine `k` again (all its nodes, through the same two-phase start on the same placement-group
        bundles) after `stop_engine(k)`; on failure whatever started is stopped again."""
        try:
            self._start([k])
        except BaseException:
            self.stop_engine(k)
            raise

    def stop_engine(self, k: int) -> None:
        """Shut engine `k` down (leader first, then its followers) and kill its actors; a dead one is skipped."""
        nodes, self.nodes[k] = self.nodes[k], []
        self._close_express(k)
        if nodes:
            name = self.names[k]
            shutdown_actors(nodes, [name] + [f"{name}/node{j}" for j in range(1, len(nodes))])

    def pids(self, k: int) -> list[int]:
        """The OS process of each node actor of engine `k` (node-rank order)."""
        return ray_get([a.pid.remote() for a in self.nodes[k]], self.timeout, f"{self.names[k]}.pid")

    @property
    def rank_offsets(self) -> list[int]:
        """Each engine's first rank in the weight-update group (`sync_rank_offsets`: the trainer is rank 0, engine
        k's TP rank t is rank_offsets[k] + t; a multi-node engine counts all its GPUs, its leader joins them all)."""
        return sync_rank_offsets(self.tp_sizes)

    @property
    def sync_world_size(self) -> int:
        return 1 + sum(self.tp_sizes)

    def health(self, timeout: float) -> list[bool]:
        """Per engine: its leader and every follower answer `health` within `timeout` s (a dead actor: False)."""
        return [self.engine_health(k, timeout) for k in range(len(self.nodes))]

    def engine_health(self, k: int, timeout: float) -> bool:
        """Engine `k`'s leader and every follower answer `health` within `timeout` s (stopped or dead: False)."""
        self.health_errors.pop(k, None)  # (first: a stopped engine keeps no cause from before)
        if not self.nodes[k]:
            return False
        try:
            return all(ray_get([a.health.remote(timeout) for a in self.nodes[k]], timeout + 30,
                               f"{self.names[k]}.health"))
        except Exception as exc:  # noqa: BLE001 - any failure to answer is "not healthy"; the cause is kept
            self.health_errors[k] = exc
            return False

    def health_cause(self, k: int) -> str:
        """` (<error's first line>)` when engine `k`'s last health check raised rather than answered; else empty
        (Ray's death notices run to many lines; the reasons this goes into are one line each)."""
        exc = self.health_errors.get(k)
        if exc is None:
            return ""
        return f" ({type(exc).__name__}: {first_line(exc)})"

    def generate_async(self, groups: list[list[GenerateRequest]], timeout: float) -> "PendingGenerate":
        """Submit every group (the router picks a healthy engine per group) and return a handle for `collect`."""
        self._read_abandoned()
        requests = [req for group in groups for req in group]
        keys = [g for g, group in enumerate(groups) for _ in group]
        pending = PendingGenerate(requests, keys, [len(g) for g in groups], timeout)
        self._submit(pending, list(range(len(requests))))
        return pending

    def _submit(self, pending: "PendingGenerate", positions: list[int]) -> None:
        plan = self.router.assign([pending.requests[p] for p in positions], [pending.keys[p] for p in positions])
        for e, idx in sorted(plan.items()):
            mine = [positions[i] for i in idx]
            ref = self._generate_call(e, [pending.requests[p] for p in mine], pending.timeout)
            pending.inflight[ref] = (e, mine, time.monotonic() + pending.timeout + 30)

    def collect(self, pending: "PendingGenerate") -> list[list[GenerateResult]]:
        """Wait for every request of `pending`; results grouped as submitted. While waiting, engines with requests
        in flight are health-checked every `recovery.interval_s`; a failed engine is recovered (restart, resync,
        re-issue) when `recovery` is set, else the call raises naming it."""
        while pending.inflight:
            failed = self._wait_round(pending)
            if not failed:
                continue
            if self.recovery is None:
                e, (reason, _) = next(iter(failed.items()))
                raise ActorCallError(f"{reason}{self._dead_followers(e)}")
            lost = sorted(p for _, positions in failed.values() for p in positions)
            self.recovery.recover({e: reason for e, (reason, _) in failed.items()})
            self._read_abandoned()
            self._submit(pending, lost)  # the same requests (same seeds) on healthy engines
        out, start = [], 0
        for n in pending.group_sizes:
            out.append(pending.results[start:start + n])
            start += n
        return out

    def _wait_round(self, pending: "PendingGenerate") -> dict[int, tuple[str, list[int]]]:
        """Wait until an answer arrives, a deadline passes or a health round is due; returns the engines that failed
        (engine -> (reason, the positions they lost))."""
        now = time.monotonic()
        interval = self.recovery.interval_s if self.recovery is not None else float("inf")
        wait_s = max(0.0, min(interval, min(d for _, _, d in pending.inflight.values()) - now))
        ready = wait_any(list(pending.inflight), wait_s)
        failed: dict[int, tuple[str, list[int]]] = {}
        for ref in ready:
            e, positions, _ = pending.inflight.pop(ref)
            try:
                out = call_result(ref, 30, f"{self.names[e]}.generate")
            except ActorCallError as err:
                failed[e] = (str(err), positions)
                continue
            out = _opened(out, f"{self.names[e]}.generate")
            if len(out) != len(positions):
                raise EngineError(f"{self.names[e]} returned {len(out)} results for {len(positions)} requests")
            for p, res in zip(positions, out):
                pending.results[p] = res
        if ready:
            return failed
        now = time.monotonic()
        for ref, (e, positions, deadline) in list(pending.inflight.items()):
            if deadline <= now:
                del pending.inflight[ref]
                self._hold(ref)
                failed.setdefault(e, (f"{self.names[e]}.generate: no answer within {pending.timeout + 30:.0f} s",
                                      []))[1].extend(positions)
        if self.recovery is not None:
            for e in sorted({k for k, _, _ in pending.inflight.values()} - set(failed)):
                if not self.engine_health(e, self.recovery.health_timeout_s):
                    failed[e] = (f"{self.names[e]} failed its health check while generating{self.health_cause(e)}",
                                 [])
        for e, (_, lost) in failed.items():  # everything else in flight on a failed engine is lost with it
            for ref in [r for r, (k, _, _) in pending.inflight.items() if k == e]:
                lost.extend(pending.inflight.pop(ref)[1])
                self._hold(ref)
        return failed

    def _hold(self, ref) -> None:
        """An abandoned call: a Ray ref is held until it ends (`_read_abandoned`); an express call's reply is
        dropped when it comes."""
        if not abandon(ref):
            self._abandoned.append(ref)

    def _read_abandoned(self, timeout: float = 0.0) -> None:
        """Read (and discard) the answers of abandoned calls that have ended; the others stay held."""
        if not self._abandoned:
            return
        done, self._abandoned = ray.wait(self._abandoned, num_returns=len(self._abandoned), timeout=timeout)
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - the engine failed: its call's error was reported when it did
                pass

    def _dead_followers(self, e: int) -> str:
        dead = []
        for j, a in enumerate(self.followers[e]):
            try:
                alive = ray_get(a.health.remote(10.0), 40.0, f"{self.names[e]}/node{j + 1}.health")
            except ActorCallError:
                alive = False
            if not alive:
                dead.append(j + 1)
        return f"; {self.names[e]}'s follower node rank(s) {dead} are not alive" if dead else ""

    def generate(self, groups, timeout: float):
        return self.collect(self.generate_async(groups, timeout))

    def call_all(self, method: str, timeout: float, **kwargs):
        """`method(**kwargs, timeout=timeout)` on every engine (e.g. `release_memory`, tags=None)."""
        return ray_get([a.call.remote(method, timeout=timeout, **kwargs) for a in self.actors], timeout + 30,
                       f"engines.{method}")

    def version_of(self, k: int) -> int:
        """The weight version engine `k` serves."""
        return ray_get(self.nodes[k][0].weight_version.remote(), self.timeout, f"{self.names[k]}.weight_version")

    def versions(self) -> list[int]:
        return ray_get([a.weight_version.remote() for a in self.actors], self.timeout, "engines.weight_version")

    def score(self, sequences: list[list[int]], timeout: float) -> dict[str, list[list[float]]]:
        """Prompt logprobs of `sequences` on every engine, by engine name."""
        running = self.running
        out = ray_get([self.nodes[k][0].call.remote("score", sequences=sequences, timeout=timeout) for k in running],
                      timeout + 30, "engines.score")
        return {self.names[k]: o for k, o in zip(running, out)}

    def shutdown(self) -> None:
        """Leaders first (a leader's shutdown stops its engine's TP ranks on every node), then the followers."""
        for k in range(len(self.nodes)):
            self._close_express(k)
        started = [(n, nodes) for n, nodes in zip(self.names, self.nodes) if nodes]
        shutdown_actors([nodes[0] for _, nodes in started], [n for n, _ in started])
        shutdown_actors([a for _, nodes in started for a in nodes[1:]],
                        [f"{n}/node{j}" for n, nodes in started for j in range(1, len(nodes))])
        self.nodes = [[] for _ in self.nodes]
        self._read_abandoned(timeout=10.0)  # their actors are gone: the calls end with the actors' deaths
        self._abandoned = []


def _abandon_all(calls) -> None:
    """The calls a failed gather no longer waits for: express replies are dropped when they come."""
    for ref in calls:
        abandon(ref)


def _close_all(clients) -> None:
    for c in clients or []:
        c.close()


def open_express(trainers: list[TrainerGroup], engines: EngineGroup | None, enabled: bool) -> str:
    """Give the run express calls (`beamrl.loop.express`) when `enabled` (`placement.express_calls`) and every trainer
    rank and engine leader runs on this node: the driver's train-step and rollout calls and the weight sync's engine
    calls then go over sockets. Returns the console line that says which way the calls go."""
    if not enabled:
        return "actor calls: through Ray (placement.express_calls: false)"
    here = ray.get_runtime_context().get_node_id()
    try:
        per_trainer = [g.express_addresses() for g in trainers]
        per_engine = [engines.express_address(k) for k in engines.running] if engines is not None else []
    except ActorCallError as exc:  # an actor could not open its server (a dead one fails its next call, loudly)
        return f"actor calls: through Ray (an express server could not be opened: {first_line(exc)})"
    nodes = {a.node_id for a in [*(a for x in per_trainer for a in x), *per_engine]}
    if nodes != {here}:
        where = f"{len(nodes)} node(s)" + ("" if here in nodes else ", none of them the driver's")
        return f"actor calls: through Ray (express calls need every actor on the driver's node; these run on {where})"
    opened: list[ExpressClient] = []
    trainer_clients: list[list[ExpressClient]] = []
    try:
        for addresses in per_trainer:
            trainer_clients.append([])
            for r, a in enumerate(addresses):
                trainer_clients[-1].append(ExpressClient(a, f"trainer rank {r}"))
                opened.append(trainer_clients[-1][-1])
        engine_clients = []
        for k, a in zip(engines.running if engines is not None else [], per_engine):
            engine_clients.append(ExpressClient(a, engines.names[k]))
            opened.append(engine_clients[-1])
    except (ExpressPeerLost, AuthenticationError, OSError) as exc:  # e.g. actors in another network namespace
        _close_all(opened)
        return f"actor calls: through Ray (an express channel could not be opened: {first_line(exc)})"
    for g, clients in zip(trainers, trainer_clients):
        g.use_express(clients)
    if engines is not None:
        engines.use_express(dict(zip(engines.running, zip(per_engine, engine_clients))))
    return "actor calls: express (every actor on this node; Ray places, watches and restarts them)"

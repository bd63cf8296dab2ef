"""The driver's handles on actor groups: the SPMD trainer ranks and the rollout engines."""

from __future__ import annotations

import itertools

import ray

from beamrl.cluster.placement import sync_rank_offsets
from beamrl.loop.actors import EngineActor, TrainerActor, TrainerRankSpec
from beamrl.loop.ray_utils import ActorCallError, ray_get
from beamrl.protocols.rollout import EngineError, GenerateRequest, GenerateResult


def shutdown_actors(actors: list, names: list[str]) -> None:
    """Ask each actor to release its resources (30 s each), then kill it; best effort at teardown."""
    for a, n in zip(actors, names):
        try:
            ray_get(a.shutdown.remote(), 30, f"{n}.shutdown")
        except Exception:  # noqa: BLE001 - the actor is killed next anyway
            pass
        try:
            ray.kill(a)
        except Exception:  # noqa: BLE001 - Ray itself may already be gone
            pass


class TrainerGroup:
    """All Megatron ranks of the policy. Every call goes to every rank (SPMD); rank 0's answer is returned."""

    def __init__(self, setup, hf_checkpoint: str, world_size: int, timeout: float,
                 actor_options: list[dict], num_threads: int = 1):
        self.timeout = timeout
        self.actors = [TrainerActor.options(**actor_options[r]).remote(num_threads=num_threads)
                       for r in range(world_size)]
        addr, port = ray_get(self.actors[0].rendezvous_address.remote(), timeout, "trainer rank 0 address")
        ray_get([a.start.remote(spec=TrainerRankSpec(r, world_size, addr, port, num_threads), setup=setup,
                                hf_checkpoint=hf_checkpoint) for r, a in enumerate(self.actors)],
                timeout, "trainer start-up (building Megatron ranks)")
        dp = ray_get([a.data_parallel_rank.remote() for a in self.actors], timeout, "trainer.data_parallel_rank")
        self.dp_ranks = [d for d, _ in dp]
        self.dp_size = dp[0][1]

    def _all(self, what: str, timeout: float | None, fn):
        return ray_get([fn(a) for a in self.actors], timeout or self.timeout, f"trainer.{what}")

    def compute_logprobs(self, batch, temperature: float, replay: bool, return_entropy: bool = False):
        return self._all("compute_logprobs", None, lambda a: a.compute_logprobs.remote(
            batch, temperature=temperature, return_entropy=return_entropy, replay=replay))[0]

    def train_step(self, micro_batches, loss_fn, replay: bool, temperature: float = 1.0):
        """One optimizer step over the step's micro-batches: data-parallel rank d trains on the d-th contiguous
        share (ranks of one model-parallel group get the same share). The loss normaliser inside `loss_fn` is
        the whole step's, so the sum over DP ranks is the full-batch loss."""
        if len(micro_batches) % self.dp_size:
            raise ValueError(f"{len(micro_batches)} micro-batches cannot be split evenly over {self.dp_size} "
                             f"data-parallel ranks")
        per = len(micro_batches) // self.dp_size
        shares = [micro_batches[d * per:(d + 1) * per] for d in range(self.dp_size)]
        return ray_get([a.train_step.remote(shares[d], loss_fn=loss_fn, replay=replay, temperature=temperature)
                        for a, d in zip(self.actors, self.dp_ranks)], self.timeout, "trainer.train_step")[0]

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
        wait = request.timeout * 4 + 60  # pause, begin, the buckets, commit and the probe each have their own limit
        out = self._all("sync_weights", wait, lambda a: a.sync_weights.remote(
            receivers=engines.actors, engine_names=engines.names, engine_tp=engines.tp_sizes, request=request))
        return out[0]

    def save_lora_adapter(self, out_dir: str) -> str:
        """Write the trainer's LoRA adapter in PEFT format (docs/lora.md) into `out_dir`; returns it."""
        return self._all("save_lora_adapter", None, lambda a: a.save_lora_adapter.remote(out_dir=out_dir))[0]

    def export_hf_checkpoint(self, out_dir: str) -> str:
        return self._all("export_hf_checkpoint", None, lambda a: a.export_hf_checkpoint.remote(out_dir=out_dir))[0]

    def shutdown(self) -> None:
        shutdown_actors(self.actors, [f"trainer-{r}" for r in range(len(self.actors))])
        self.actors = []


class EngineGroup:
    """Rollout engines as actors: one `EngineActor` per node of each engine. All API traffic (generation, scoring,
    weight updates) goes to each engine's leader (node rank 0, `actors`); the other nodes (`followers`) are
    watched for liveness. Requests of one prompt group go to one engine (prefix-cache affinity).

    Start-up has two phases: every node actor reserves its address and ports, then all nodes of every engine
    start together, each told the leader's meeting point (`dist_init_addr`). `engines[k]` lists engine k's node
    factories in node-rank order and `node_options[k]` their Ray options (their placement-group bundles)."""

    def __init__(self, engines: list[list], timeout: float, node_options: list[list[dict]], num_threads: int = 1):
        self.timeout, self.num_threads = timeout, num_threads
        self.factories, self.node_options = engines, node_options
        self.names = [nodes[0].name for nodes in engines]
        self.nodes: list[list] = [[] for _ in engines]
        try:
            self._start(list(range(len(engines))))
        except BaseException:
            self.shutdown()  # the servers that did start must not outlive a failed start-up
            raise

    @property
    def actors(self) -> list:
        """Each engine's leader (node rank 0): every API call goes there (none once shut down)."""
        return [nodes[0] for nodes in self.nodes if nodes]

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
        self.tp_sizes = ray_get([a.tp_size.remote() for a in self.actors], self.timeout, "engines.tp_size")
        planned = [nodes[0].rollout.engine_tp for nodes in self.factories]
        if self.tp_sizes != planned:
            raise EngineError(f"engines report TP sizes {self.tp_sizes}, the plan has {planned} (rollout.engine_tp)")

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
        refs = [[a.health.remote(timeout) for a in nodes] for nodes in self.nodes]
        out = []
        for name, rs in zip(self.names, refs):
            try:
                out.append(all(ray_get(rs, timeout + 30, f"{name}.health")))
            except Exception:  # noqa: BLE001 - any failure to answer is "not healthy"
                out.append(False)
        return out

    def generate_async(self, groups: list[list[GenerateRequest]], timeout: float):
        """Submit every group (round-robin over engines) and return a handle for `collect`."""
        per_engine: list[list[GenerateRequest]] = [[] for _ in self.actors]
        placement = []
        for gi, (group, e) in enumerate(zip(groups, itertools.cycle(range(len(self.actors))))):
            placement.append((e, len(per_engine[e]), len(group)))
            per_engine[e].extend(group)
        refs = [a.call.remote("generate", requests=reqs, timeout=timeout) if reqs else None
                for a, reqs in zip(self.actors, per_engine)]
        return refs, placement, timeout

    def collect(self, handle) -> list[list[GenerateResult]]:
        refs, placement, timeout = handle
        results = []
        for e, (r, n) in enumerate(zip(refs, self.names)):
            try:
                results.append(ray_get(r, timeout + 30, f"{n}.generate") if r is not None else [])
            except ActorCallError as err:  # a dead follower node is the likely cause: name it
                raise ActorCallError(f"{err}{self._dead_followers(e)}") from None
        out = []
        for e, start, n in placement:
            out.append(results[e][start:start + n])
            if len(out[-1]) != n:
                raise EngineError(f"{self.names[e]} returned {len(results[e])} results for {len(refs)} requests")
        return out

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

    def versions(self) -> list[int]:
        return ray_get([a.weight_version.remote() for a in self.actors], self.timeout, "engines.weight_version")

    def score(self, sequences: list[list[int]], timeout: float) -> dict[str, list[list[float]]]:
        """Prompt logprobs of `sequences` on every engine, by engine name."""
        out = ray_get([a.call.remote("score", sequences=sequences, timeout=timeout) for a in self.actors],
                      timeout + 30, "engines.score")
        return dict(zip(self.names, out))

    def shutdown(self) -> None:
        """Leaders first (a leader's shutdown stops its engine's TP ranks on every node), then the followers."""
        started = [(n, nodes) for n, nodes in zip(self.names, self.nodes) if nodes]
        shutdown_actors([nodes[0] for _, nodes in started], [n for n, _ in started])
        shutdown_actors([a for _, nodes in started for a in nodes[1:]],
                        [f"{n}/node{j}" for n, nodes in started for j in range(1, len(nodes))])
        self.nodes = [[] for _ in self.nodes]

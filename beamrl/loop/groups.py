"""The driver's handles on actor groups: the SPMD trainer ranks and the rollout engines."""

from __future__ import annotations

import itertools

import ray

from beamrl.loop.actors import EngineActor, TrainerActor, TrainerRankSpec
from beamrl.loop.ray_utils import ray_get
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

    def sleep(self, timeout: float) -> list[dict]:
        """Every rank releases its device state (colocated placement); one `SleepReport` dict per rank."""
        return self._all("sleep", timeout, lambda a: a.sleep.remote())

    def wake(self, timeout: float) -> list[dict]:
        """Every rank restores what `sleep` released; one `SleepReport` dict per rank."""
        return self._all("wake", timeout, lambda a: a.wake.remote())

    def export_hf_checkpoint(self, out_dir: str) -> str:
        return self._all("export_hf_checkpoint", None, lambda a: a.export_hf_checkpoint.remote(out_dir=out_dir))[0]

    def shutdown(self) -> None:
        shutdown_actors(self.actors, [f"trainer-{r}" for r in range(len(self.actors))])
        self.actors = []


class EngineGroup:
    """Rollout engines as actors. Requests of one prompt group go to one engine (prefix-cache affinity)."""

    def __init__(self, factories: list, timeout: float, actor_options: list[dict], num_threads: int = 1):
        self.timeout = timeout
        self.names = [f.name for f in factories]
        self.actors = [EngineActor.options(**actor_options[i]).remote(factory=f, num_threads=num_threads)
                       for i, f in enumerate(factories)]
        ray_get([a.ready.remote() for a in self.actors], timeout, "rollout engine start-up")
        self.tp_sizes = ray_get([a.tp_size.remote() for a in self.actors], timeout, "engines.tp_size")

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
        results = [ray_get(r, timeout + 30, f"{n}.generate") if r is not None else []
                   for r, n in zip(refs, self.names)]
        out = []
        for e, start, n in placement:
            out.append(results[e][start:start + n])
            if len(out[-1]) != n:
                raise EngineError(f"{self.names[e]} returned {len(results[e])} results for {len(refs)} requests")
        return out

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
        shutdown_actors(self.actors, self.names)
        self.actors = []

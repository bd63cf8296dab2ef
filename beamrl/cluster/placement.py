"""The placement plan: which node and GPU each trainer rank and each rollout-engine process gets.

`plan_placement` is a pure function of the recipe's sections. `--dry-run` prints its result and the launcher
(`beamrl.cluster.ray_groups`) builds Ray placement groups from it, one bundle per GPU. On `cluster.device: cpu`
every "GPU" is a CPU worker slot, and the same plan runs on one machine (a simulated node per recipe node).

Rules (a broken one raises `ConfigError` naming the recipe field to change; `beamrl.recipe.layout.placement_of`
turns it into a `RecipeError`):
- trainer rank r takes global slot r, i.e. node r // gpus_per_node and GPU r % gpus_per_node. Rank numbers come
  from the plan and follow Megatron's order (TP ranks adjacent, see `ParallelConfig.coordinates`). Every TP group
  and every expert-TP group must stay inside one node (`trainer.tp`, `trainer.etp`);
- disaggregated: the engines take the slots after the trainer's, engine k the k-th run of `engine_tp` slots. An
  engine with engine_tp <= gpus_per_node stays inside one node (a fraction of it). A larger engine takes whole
  nodes of its own (`trainer.num_gpus` when the trainer's share breaks that alignment);
- colocated: engine k takes the same slots as trainer ranks k * engine_tp ... (k + 1) * engine_tp - 1;
- the KL reference ranks (`algorithm.kl.reference`) share the policy ranks' slots;
- an engine that spans nodes runs one process per node. Its node rank j holds TP ranks j * tp_per_node and up;
  node rank 0 is the leader and serves the API;
- weight-sync ranks (distributed transport): the trainer is rank 0, and engine k's TP rank t is
  1 + (the GPUs of the engines before k) + t, so the group's world size is 1 + all engine GPUs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

from beamrl.config import ConfigError
from beamrl.trainer.megatron.config import ParallelConfig, RankCoordinates


def sync_rank_offsets(tp_sizes: list[int]) -> list[int]:
    """Each engine's first rank in the weight-update group: the trainer is rank 0 and engine k's TP rank t is
    1 + sum(tp_sizes[:k]) + t (an engine that spans nodes counts all its GPUs: its leader joins them all). The
    distributed transport's own rule (`update_group_ranks`), so the plan prints the ranks the sync uses."""
    from beamrl.sync.transports.distributed import update_group_ranks

    return update_group_ranks(tp_sizes)[0]


class PlacementError(RuntimeError):
    """Where the actors were placed breaks a rule of the plan (e.g. a TP group on two nodes)."""


@dataclass(frozen=True, order=True)
class Slot:
    """One GPU (a CPU worker slot on cluster.device=cpu): `node` of the plan, `gpu` index inside that node."""

    node: int
    gpu: int


@dataclass(frozen=True)
class TrainerRank:
    """One Megatron rank: its slot and its coordinates in Megatron's grids."""

    slot: Slot
    coords: RankCoordinates

    @property
    def rank(self) -> int:
        return self.coords.rank


@dataclass(frozen=True)
class EngineNode:
    """The part of an engine on one node: one process (one Ray actor), node rank `node_rank` of the engine."""

    engine: int
    node_rank: int
    slots: tuple[Slot, ...]  # in TP-rank order, contiguous GPUs of one node
    tp_ranks: tuple[int, ...]

    @property
    def node(self) -> int:
        return self.slots[0].node

    @property
    def base_gpu(self) -> int:
        """The first GPU of this part inside its node (SGLang's `--base-gpu-id`)."""
        return self.slots[0].gpu


@dataclass(frozen=True)
class EnginePlacement:
    """One rollout engine: its node parts (node rank order), its weight-sync rank offset and, colocated, the
    trainer ranks whose GPUs it shares."""

    index: int
    name: str
    tp: int
    nodes: tuple[EngineNode, ...]
    sync_rank_offset: int
    shares_with_trainer: tuple[int, ...] = ()

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def slots(self) -> tuple[Slot, ...]:
        return tuple(s for n in self.nodes for s in n.slots)


@dataclass(frozen=True)
class Placement:
    """The whole plan. `slots_per_node` is cluster.gpus_per_node (CPU worker slots on cluster.device=cpu)."""

    device: str
    mode: str
    num_nodes: int
    slots_per_node: int
    trainer: tuple[TrainerRank, ...]
    engines: tuple[EnginePlacement, ...]
    reference: bool = False

    @property
    def slots(self) -> list[Slot]:
        """Every slot of the cluster, sorted by node and GPU (one placement-group bundle each)."""
        return [Slot(n, g) for n in range(self.num_nodes) for g in range(self.slots_per_node)]

    @property
    def sync_world_size(self) -> int:
        """World size of the weight-update group: the trainer (rank 0) plus every engine GPU."""
        return 1 + sum(e.tp for e in self.engines)

    def engine_nodes(self) -> list[EngineNode]:
        return [n for e in self.engines for n in e.nodes]

    def check(self, node_of: Callable[[Slot], Hashable] | None = None) -> None:
        """Raise `PlacementError` if a rule does not hold when slot s sits on node `node_of(s)` (default: the
        plan's own node; the launcher passes the node Ray actually gave each slot's bundle):
        every trainer TP and expert-TP group on one node; every engine part on one node and an engine's parts on
        different nodes; a disaggregated engine that spans nodes alone on its nodes; no slot used twice."""
        where = node_of or (lambda s: s.node)
        groups: dict[tuple, list[TrainerRank]] = {}
        for t in self.trainer:
            groups.setdefault(("TP",) + t.coords.tp_group, []).append(t)
            groups.setdefault(("expert-TP",) + t.coords.expert_tp_group, []).append(t)
        for key, ranks in groups.items():
            nodes = {where(t.slot) for t in ranks}
            if len(nodes) > 1:
                raise PlacementError(f"trainer {key[0]} group of ranks {[t.rank for t in ranks]} spans "
                                     f"{len(nodes)} nodes ({sorted(map(str, nodes))})")
        trainer_nodes = {where(t.slot) for t in self.trainer}
        used: dict[Slot, str] = {} if self.mode == "colocated" else {t.slot: f"trainer rank {t.rank}"
                                                                     for t in self.trainer}
        for e in self.engines:
            part_nodes = []
            for part in e.nodes:
                nodes = {where(s) for s in part.slots}
                if len(nodes) > 1:
                    raise PlacementError(f"engine {e.name} node rank {part.node_rank} spans nodes "
                                         f"{sorted(map(str, nodes))}")
                part_nodes.append(nodes.pop())
                for s in part.slots:
                    if s in used:
                        raise PlacementError(f"slot {s} is given to both {used[s]} and engine {e.name}")
                    used[s] = f"engine {e.name}"
            if len(set(part_nodes)) != len(part_nodes):
                raise PlacementError(f"engine {e.name}: two of its node ranks share a node ({part_nodes})")
            if self.mode == "disaggregated" and e.nnodes > 1:
                others = trainer_nodes | {where(s) for o in self.engines if o is not e for s in o.slots}
                shared = set(part_nodes) & others
                if shared:
                    raise PlacementError(f"engine {e.name} spans nodes but shares node(s) {sorted(map(str, shared))} "
                                         "with other actors")


def plan_placement(*, device: str, num_nodes: int, gpus_per_node: int, trainer: ParallelConfig,
                   trainer_gpus: int, engine: str, num_engines: int, engine_tp: int, mode: str,
                   reference: bool = False) -> Placement:
    """The placement of a run (see the module docstring) from the recipe's `cluster` fields, the trainer's parallel
    sizes and `trainer.num_gpus`, the `rollout` engine fields, `placement.mode` and `algorithm.kl.reference`.
    Raises `ConfigError` naming the recipe field to change."""
    gpn = gpus_per_node

    def slot(i: int) -> Slot:
        return Slot(i // gpn, i % gpn)

    ranks = tuple(TrainerRank(slot(r), trainer.coordinates(r, trainer_gpus)) for r in range(trainer_gpus))
    _require_groups_in_nodes(ranks, trainer)
    first = 0 if mode == "colocated" else trainer_gpus
    engines = []
    for k, offset in enumerate(sync_rank_offsets([engine_tp] * num_engines)):
        start = first + k * engine_tp
        shares = tuple(range(start, start + engine_tp)) if mode == "colocated" else ()
        engines.append(_plan_engine(k, f"{engine}-{k}", start, engine_tp, gpn, offset, shares, trainer_gpus))
    plan = Placement(device=device, mode=mode, num_nodes=num_nodes, slots_per_node=gpn, trainer=ranks,
                     engines=tuple(engines), reference=reference)
    plan.check()  # the rules above make these hold; a planning bug must not reach the cluster
    return plan


def _require_groups_in_nodes(ranks: tuple[TrainerRank, ...], trainer: ParallelConfig) -> None:
    for name, field, key in (("TP", "tp", lambda t: t.coords.tp_group),
                             ("expert-TP", "etp", lambda t: t.coords.expert_tp_group)):
        groups: dict[tuple, list[TrainerRank]] = {}
        for t in ranks:
            groups.setdefault(key(t), []).append(t)
        for members in groups.values():
            nodes = sorted({t.slot.node for t in members})
            if len(nodes) > 1:
                raise ConfigError(f"trainer.{field}", getattr(trainer, field),
                                  f"a {name} group must stay inside one node, but ranks "
                                  f"{members[0].rank}-{members[-1].rank} would span nodes {nodes}; use a {field} "
                                  "that divides cluster.gpus_per_node (or a trainer that fits in one node)")


def _plan_engine(k: int, name: str, start: int, tp: int, gpn: int, offset: int, shares: tuple[int, ...],
                 n_trainer: int) -> EnginePlacement:
    first_node, first_gpu = divmod(start, gpn)
    if tp <= gpn:
        if first_gpu + tp > gpn:
            raise ConfigError("trainer.num_gpus", n_trainer,
                              f"engine {name} (engine_tp {tp}) would straddle nodes {first_node} and "
                              f"{first_node + 1}: the trainer's GPUs must leave each node a multiple of "
                              f"rollout.engine_tp={tp} free")
        parts = ((tuple(Slot(first_node, first_gpu + i) for i in range(tp)), tuple(range(tp))),)
    else:
        if first_gpu:
            raise ConfigError("trainer.num_gpus", n_trainer,
                              f"engine {name} (engine_tp {tp}) spans nodes and needs whole nodes, but would "
                              f"start at GPU {first_gpu} of node {first_node}: make trainer.num_gpus a multiple "
                              f"of cluster.gpus_per_node={gpn}")
        parts = tuple((tuple(Slot(first_node + j, i) for i in range(gpn)), tuple(range(j * gpn, (j + 1) * gpn)))
                      for j in range(tp // gpn))
    nodes = tuple(EngineNode(k, j, slots, tp_ranks) for j, (slots, tp_ranks) in enumerate(parts))
    return EnginePlacement(k, name, tp, nodes, offset, shares)

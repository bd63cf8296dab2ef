"""Ray placement groups built from a `Placement`: one bundle per GPU (a CPU worker slot on cluster.device=cpu).

Each node of the plan gets one STRICT_PACK group of `gpus_per_node` bundles, so a plan node is always one Ray
node. Ray decides which node each group lands on, and which GPU each bundle holds, so both are read back after
`ready()`:
- the node of every bundle (`placement_group_table`) and that node's address (and, on a simulated node, its
  identity resource). The groups are then sorted by node address and identity, and plan node i is the i-th;
- the GPU id of every bundle, from a small task scheduled onto it (its `ray.get_gpu_ids()`). Inside a node the
  bundles are sorted by GPU id, so plan GPU g is the g-th GPU that Ray gave the node. The task also checks that
  work scheduled onto a bundle runs on the node the table names.
Then the plan's rules are checked against the nodes Ray really used (`Placement.check`), and every actor is
scheduled onto its slot's bundle (`actor_options`).
"""

from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from beamrl.cluster.placement import Placement, PlacementError, Slot
from beamrl.cluster.ray_start import NODE_RESOURCE_PREFIX, WORKER_SLOT

# What a placement-group probe takes from its bundle while it runs (a sliver, returned at once).
_PROBE_SHARE = 0.01


def slot_resource(device: str) -> str:
    """The resource a slot reserves: a GPU, or a CPU worker slot on cluster.device=cpu."""
    return "GPU" if device == "cuda" else WORKER_SLOT


@dataclass(frozen=True)
class Bundle:
    """Where one slot of the plan really is."""

    group: Any  # the PlacementGroup
    index: int  # bundle index inside its group
    node_id: str
    node_ip: str
    gpu_id: int | None  # None on CPU


@ray.remote(num_cpus=0)
def _probe() -> tuple[str, list]:
    return ray.get_runtime_context().get_node_id(), [int(g) for g in ray.get_gpu_ids()]


class PlacementGroups:
    """The placement groups of a run and the bundle of every slot (see the module docstring)."""

    def __init__(self, plan: Placement, timeout: float, log=print):
        self.plan = plan
        self.resource = slot_resource(plan.device)
        t0 = time.perf_counter()
        bundle = {self.resource: 1}
        self.groups = [placement_group([bundle] * plan.slots_per_node, strategy="STRICT_PACK",
                                       name=f"beamrl-node-{i}") for i in range(plan.num_nodes)]
        try:
            self._wait_ready(timeout)
            self.bundles = self._read_back(timeout)
            plan.check(lambda s: self.bundles[s].node_id)
        except BaseException:
            self.remove()
            raise
        nodes = ", ".join(f"{n}={self.bundles[Slot(n, 0)].node_ip}/{self.bundles[Slot(n, 0)].node_id[:8]}"
                          for n in range(plan.num_nodes))
        log(f"placement: {plan.num_nodes} placement group(s) of {plan.slots_per_node} {self.resource} bundle(s) "
            f"ready in {time.perf_counter() - t0:.1f} s; plan node -> Ray node: {nodes}")

    # ------------------------------------------------------------------ set-up
    def _wait_ready(self, timeout: float) -> None:
        ready, pending = ray.wait([g.ready() for g in self.groups], num_returns=len(self.groups), timeout=timeout)
        if pending:
            have = ray.cluster_resources().get(self.resource, 0)
            raise PlacementError(
                f"{len(pending)} of {len(self.groups)} node placement group(s) ({self.plan.slots_per_node} x "
                f"{self.resource} on one node each) were not placed within {timeout:.0f} s; the Ray cluster has "
                f"{len(ray.nodes())} node(s) and {have:g} {self.resource} in all, the recipe asks for "
                f"{self.plan.num_nodes} node(s) x {self.plan.slots_per_node} "
                "(cluster.num_nodes, cluster.gpus_per_node)")

    def _read_back(self, timeout: float) -> dict[Slot, Bundle]:
        nodes = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
        per_group = []
        for g in self.groups:
            table = placement_group_table(g)["bundles_to_node_id"]
            node_ids = {table[i] for i in range(self.plan.slots_per_node)}
            if len(node_ids) != 1:  # STRICT_PACK promises one node; check rather than trust
                raise PlacementError(f"placement group {g.id.hex()[:8]} spans nodes {sorted(node_ids)}")
            per_group.append(node_ids.pop())
        if len(set(per_group)) != len(per_group):
            raise PlacementError(f"two plan nodes landed on one Ray node ({per_group}): the Ray nodes have more than "
                                 f"cluster.gpus_per_node={self.plan.slots_per_node} {self.resource} each; set "
                                 "cluster.gpus_per_node to what a node really has")
        order = sorted(range(len(self.groups)), key=lambda i: _node_key(nodes[per_group[i]]))
        self.groups = [self.groups[i] for i in order]
        per_group = [per_group[i] for i in order]
        probes = {(n, b): _probe.options(**self._options(g, b, _PROBE_SHARE)).remote()
                  for n, g in enumerate(self.groups) for b in range(self.plan.slots_per_node)}
        try:
            answers = dict(zip(probes, ray.get(list(probes.values()), timeout=timeout)))
        except ray.exceptions.GetTimeoutError:
            raise PlacementError(f"the placement-group probes did not run within {timeout:.0f} s") from None
        bundles: dict[Slot, Bundle] = {}
        for n, g in enumerate(self.groups):
            found = []
            for b in range(self.plan.slots_per_node):
                node_id, gpus = answers[(n, b)]
                if node_id != per_group[n]:
                    raise PlacementError(f"a task scheduled onto bundle {b} of plan node {n} ran on node {node_id}, "
                                         f"not on {per_group[n]} as Ray's placement-group table says")
                found.append((gpus[0] if gpus else None, b))
            found.sort(key=lambda x: (x[0] is None, x[0] if x[0] is not None else x[1]))
            ip = nodes[per_group[n]]["NodeManagerAddress"]
            for gpu, (gpu_id, b) in enumerate(found):
                bundles[Slot(n, gpu)] = Bundle(g, b, per_group[n], ip, gpu_id)
        return bundles

    # ------------------------------------------------------------------ use
    def _options(self, group, bundle_index: int, share: float) -> dict:
        out: dict[str, Any] = {"num_cpus": 0, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=bundle_index)}
        if self.resource == "GPU":
            out["num_gpus"] = share
        else:
            out["resources"] = {self.resource: share}
        return out

    def actor_options(self, slot: Slot, share: float) -> dict:
        """Ray options that put an actor on `slot`'s bundle, taking `share` of its GPU (worker slot)."""
        b = self.bundles[slot]
        return self._options(b.group, b.index, share)

    def gpu_ids(self, node: int) -> list[int] | None:
        """The GPU ids of plan node `node` in plan order (plan GPU g is the g-th); None on CPU."""
        ids = [self.bundles[Slot(node, g)].gpu_id for g in range(self.plan.slots_per_node)]
        return None if any(i is None for i in ids) else ids

    def node_ip(self, node: int) -> str:
        return self.bundles[Slot(node, 0)].node_ip

    def remove(self) -> None:
        for g in self.groups:
            try:
                remove_placement_group(g)
            except Exception:  # noqa: BLE001 - Ray may already be gone at teardown
                pass
        self.groups = []


def _node_key(node: dict) -> tuple:
    """Sort nodes by address (numerically for IPv4/IPv6), then by a simulated node's identity resource."""
    addr = node["NodeManagerAddress"]
    try:
        ip: tuple = (0, int(ipaddress.ip_address(addr)))
    except ValueError:
        ip = (1, addr)
    ident = [int(k[len(NODE_RESOURCE_PREFIX):]) for k in node.get("Resources", {})
             if k.startswith(NODE_RESOURCE_PREFIX)]
    return ip, ident[0] if ident else -1, node["NodeID"]

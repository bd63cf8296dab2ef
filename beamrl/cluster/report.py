"""The placement plan as text (printed by `--dry-run` and at the start of a run): node -> GPUs -> role and ranks.

One line per run of GPUs of a node that play the same role: a trainer TP group (its global ranks and Megatron
coordinates), the KL reference ranks on the same GPUs, and an engine's part on that node (node rank, TP ranks, and
in disaggregated mode its ranks in the weight-update group)."""

from __future__ import annotations

from beamrl.cluster.placement import Placement, Slot


def ranges(xs) -> str:
    """Sorted integers as compact ranges: [0, 1, 2, 5] -> '0-2,5'."""
    xs = sorted(xs)
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ",".join(out)


def format_placement(plan: Placement) -> str:
    """The plan, node by node (see the module docstring)."""
    unit = "slot" if plan.device == "cpu" else "GPU"
    trainer = {t.slot: t for t in plan.trainer}
    engine_part = {s: (e, part) for e in plan.engines for part in e.nodes for s in part.slots}

    def key(s: Slot):
        t, ep = trainer.get(s), engine_part.get(s)
        return (t.coords.tp_group if t else None, (ep[0].index, ep[1].node_rank) if ep else None)

    lines = [f"placement ({plan.num_nodes} node(s) x {plan.slots_per_node} {unit}s; node -> {unit}s -> role):"]
    for node in range(plan.num_nodes):
        run: list[Slot] = []
        for gpu in range(plan.slots_per_node + 1):
            s = Slot(node, gpu) if gpu < plan.slots_per_node else None
            if run and (s is None or key(s) != key(run[-1])):
                roles = _roles(plan, run, trainer, engine_part)
                lines.append(f"  node {node} {unit}s {ranges(x.gpu for x in run)}: {roles}")
                run = []
            if s is not None:
                run.append(s)
    if plan.mode == "disaggregated":
        lines.append(f"  weight-update group: world {plan.sync_world_size} = trainer rank 0 (update-group rank 0) + "
                     f"{plan.sync_world_size - 1} engine GPUs")
    return "\n".join(lines)


def _roles(plan: Placement, run: list[Slot], trainer: dict, engine_part: dict) -> str:
    out = []
    ranks = [trainer[s] for s in run if s in trainer]
    if ranks:
        c = [t.coords for t in ranks]
        out.append(f"trainer ranks {ranges([t.rank for t in ranks])} (tp {ranges(x.tp for x in c)}, "
                   f"dp {ranges({x.dp for x in c})}, pp {ranges({x.pp for x in c})}; ep {ranges({x.ep for x in c})}, "
                   f"expert-dp {ranges({x.expert_dp for x in c})})")
        if plan.reference:
            out.append(f"KL reference ranks {ranges([t.rank for t in ranks])}")
    if run[0] in engine_part:
        e, part = engine_part[run[0]]
        text = f"engine {e.name}"
        if e.nnodes > 1:
            text += f" node rank {part.node_rank}/{e.nnodes}{' (leader: API)' if part.node_rank == 0 else ''}"
        idx = [part.slots.index(s) for s in run]
        tp = [part.tp_ranks[i] for i in idx]
        text += f" TP ranks {ranges(tp)}"
        if plan.mode == "disaggregated":
            text += f", weight-sync ranks {ranges(e.sync_rank_offset + t for t in tp)}"
        out.append(text)
    return " + ".join(out) if out else "unused"

"""The numbers of a parity run: per-token logprob gaps and routing agreement between two implementations.

`Comparison` is one row of `beamrl parity --json` ({"a": "reference", "b": "sglang", ...}); other engines
(e.g. {"a": "megatron"}) produce rows of the same shape.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Comparison:
    """`a` vs `b` in `dtype` over `tokens` scored tokens. routing_agreement is None when no routes were compared."""

    a: str
    b: str
    dtype: str
    tokens: int
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float
    routing_agreement: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def logprob_diffs(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> np.ndarray:
    """|a - b| over every token of every sequence (float64, flattened); sequences must align one to one."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} sequences of logprobs vs {len(b)}")
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        if x.shape != y.shape:
            raise ValueError(f"sequence {i}: {x.shape[0]} logprobs vs {y.shape[0]}")
        if not (np.isfinite(x).all() and np.isfinite(y).all()):
            raise ValueError(f"sequence {i}: non-finite logprob")
        out.append(np.abs(x - y))
    return np.concatenate(out) if out else np.zeros(0)


def routing_matches(a: np.ndarray, b: np.ndarray, moe_layers: Sequence[int]) -> np.ndarray:
    """Bool [rows, len(moe_layers)]: True where the two top-k expert SETS agree (order is irrelevant).

    `a`, `b`: int [rows, num_layers, k]; only the MoE layers are compared (dense rows are -1 / meaningless)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.ndim != 3:
        raise ValueError(f"route arrays must have the same [rows, layers, k] shape, got {a.shape} vs {b.shape}")
    layers = list(moe_layers)
    sa, sb = np.sort(a[:, layers, :], axis=-1), np.sort(b[:, layers, :], axis=-1)
    return (sa == sb).all(axis=-1)


def summarize(a: str, b: str, dtype: str, diffs: np.ndarray, route_matches: Sequence[np.ndarray] = ()) -> Comparison:
    """Fold per-token diffs and route match masks into one `Comparison` row."""
    if diffs.size == 0:
        raise ValueError("no tokens were compared")
    matches = [np.asarray(m, dtype=bool).ravel() for m in route_matches]
    total = sum(m.size for m in matches)
    agreement = float(sum(int(m.sum()) for m in matches) / total) if total else None
    return Comparison(a=a, b=b, dtype=dtype, tokens=int(diffs.size), mean_abs_logprob_diff=float(diffs.mean()),
                      max_abs_logprob_diff=float(diffs.max()), routing_agreement=agreement)


def format_table(rows: Sequence[Comparison]) -> str:
    """A fixed-width table of comparison rows."""
    head = f"{'a':<10} {'b':<8} {'dtype':<9} {'tokens':>7} {'mean|dlp|':>11} {'max|dlp|':>11} {'routing':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ra = "n/a" if r.routing_agreement is None else f"{100 * r.routing_agreement:.3f}%"
        lines.append(f"{r.a:<10} {r.b:<8} {r.dtype:<9} {r.tokens:>7} {r.mean_abs_logprob_diff:>11.3e} "
                     f"{r.max_abs_logprob_diff:>11.3e} {ra:>9}")
    return "\n".join(lines)


def write_json(rows: Sequence[Comparison], path: str | Path) -> None:
    """Write exactly {"comparisons": [row, ...]}."""
    Path(path).write_text(json.dumps({"comparisons": [r.to_dict() for r in rows]}, indent=2) + "\n")

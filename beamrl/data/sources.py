"""Rows from a source: a local jsonl/json/parquet file, an HF hub dataset id, or the synthetic generator.

Loading goes through HF `datasets`, which honours HF_DATASETS_OFFLINE / HF_HUB_OFFLINE: offline, a hub id
works only when it is already in the cache, and the error says so.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def looks_like_path(source: str) -> bool:
    """A filesystem path (absolute, relative with ./, ~ or a data-file suffix) rather than a hub id."""
    return (source.startswith(("/", "./", "../", "~")) or Path(source).suffix in LOCAL_BUILDERS
            or Path(source).exists())


def load_rows(source: str, split: str = "train", cache_dir: str | None = None) -> Any:
    """An HF `datasets.Dataset` of the source's rows (local files always load as split 'train')."""
    import datasets

    if looks_like_path(source):
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"data.source: file not found: {path}")
        files = sorted(p for p in path.iterdir() if p.suffix in LOCAL_BUILDERS) if path.is_dir() else [path]
        if not files:
            raise FileNotFoundError(f"data.source: no .jsonl/.json/.parquet files in {path}")
        builders = {LOCAL_BUILDERS.get(p.suffix) for p in files}
        if None in builders or len(builders) > 1:
            raise ValueError(f"data.source={source!r}: files must all be .jsonl/.json or all .parquet, got "
                             f"{[p.name for p in files]}")
        return datasets.load_dataset(builders.pop(), data_files=[str(p) for p in files], split="train",
                                     cache_dir=cache_dir)
    try:
        return datasets.load_dataset(source, split=split, cache_dir=cache_dir)
    except (ConnectionError, OSError, ValueError) as e:  # datasets reports offline misses as these
        raise FileNotFoundError(
            f"data.source={source!r} (hub dataset, split {split!r}) could not be loaded: {e}. Offline "
            "(HF_DATASETS_OFFLINE=1) a hub dataset must already be in the HF cache; otherwise point data.source "
            "at a local .jsonl/.parquet file") from None


def synthetic_addition_rows(num_samples: int, max_operand: int, seed: int) -> list[dict[str, Any]]:
    """Seeded 'a+b=' rows with a, b in [0, max_operand]; the answer is str(a + b)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "data_source": "synthetic-addition",
                     "a": a, "b": b})
    return rows

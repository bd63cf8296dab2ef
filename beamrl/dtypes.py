"""The one table of dtype names: the spelling of recipes, config.json files and SGLang's arguments."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
# What beamrl trains and serves in: float16 would need loss scaling, which the trainer does not do.
RUN_DTYPES: tuple[str, ...] = ("bfloat16", "float32")


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype of a table name; ValueError listing the names otherwise."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; allowed: {list(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """Table name of a torch dtype ("bfloat16", "float32", "float16")."""
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}; allowed: {list(DTYPES)}")

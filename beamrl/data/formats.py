"""Row schemas. Each parser returns a `ParsedRow`: chat messages, ground truth, data source, metadata.

- `dapo` (DAPO-Math-17k, verl's RL layout): `prompt` = list of {role, content} messages,
  `reward_model.ground_truth`, `data_source`; every other column goes to metadata.
- `jsonl-prompt-answer` / `synthetic-addition`: `prompt` (str), `answer` (str or number), optional
  `data_source`; every other column goes to metadata.
`FORMATS` maps a recipe's `data.format` to its parser `fn(row, index) -> ParsedRow`; register more there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from beamrl.registry import Registry


@dataclass(frozen=True)
class ParsedRow:
    messages: list[dict[str, str]]
    ground_truth: str
    data_source: str
    metadata: dict[str, Any]


class RowFormatError(ValueError):
    """A row lacks a required column; the message names the row index, the column and the format."""


def _require(row: dict, key: str, fmt: str, index: int) -> Any:
    if key not in row or row[key] is None:
        raise RowFormatError(f"data row {index}: format {fmt!r} needs column {key!r}; row has {sorted(row)}")
    return row[key]


def parse_dapo(row: dict[str, Any], index: int) -> ParsedRow:
    prompt = _require(row, "prompt", "dapo", index)
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        raise RowFormatError(f"data row {index}: format 'dapo' needs 'prompt' as a list of {{role, content}} "
                             f"messages, got {type(prompt).__name__}")
    rm = _require(row, "reward_model", "dapo", index)
    if not isinstance(rm, dict) or rm.get("ground_truth") is None:
        raise RowFormatError(f"data row {index}: format 'dapo' needs 'reward_model.ground_truth'")
    meta = {k: v for k, v in row.items() if k not in ("prompt", "data_source")}
    meta["reward_model"] = {k: v for k, v in rm.items() if k != "ground_truth"}
    return ParsedRow([{"role": m["role"], "content": m["content"]} for m in prompt], str(rm["ground_truth"]),
                     str(row.get("data_source") or "dapo"), meta)


def parse_prompt_answer(row: dict[str, Any], index: int, fmt: str = "jsonl-prompt-answer") -> ParsedRow:
    prompt = _require(row, "prompt", fmt, index)
    if not isinstance(prompt, str):
        raise RowFormatError(f"data row {index}: format {fmt!r} needs 'prompt' as a string")
    answer = _require(row, "answer", fmt, index)
    meta = {k: v for k, v in row.items() if k not in ("prompt", "answer", "data_source")}
    return ParsedRow([{"role": "user", "content": prompt}], str(answer), str(row.get("data_source") or fmt), meta)


FORMATS: Registry = Registry("data format")
FORMATS.register("dapo")(parse_dapo)
FORMATS.register("jsonl-prompt-answer")(parse_prompt_answer)
FORMATS.register("synthetic-addition")(lambda row, index: parse_prompt_answer(row, index, "synthetic-addition"))

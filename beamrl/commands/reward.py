"""`beamrl reward test FN --data FILE.jsonl`: run a reward function on dataset rows and print the scores.

Rows are JSON objects, one per line. Fields are taken from these keys unless `--field-map FIELD=PATH`
names another (PATH may be dotted, e.g. `ground_truth=reward_model.ground_truth`):

    prompt <- prompt, completion <- completion | response, ground_truth <- ground_truth |
    reward_model.ground_truth, data_source <- data_source, prompt_ids / completion_ids <- same names,
    metadata <- every other top-level key of the row.

DAPO-Math-17k rows (chat-message `prompt`, `reward_model.ground_truth`, `data_source`) therefore work as is
once they carry a `completion`. FN may name a module in the current directory.
Exit code: 0 all rows scored, 1 some row failed or timed out, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

NAME = "reward"
HELP = "Work with reward functions (test one on a JSONL file)."

DEFAULT_PATHS: dict[str, tuple[str, ...]] = {
    "prompt": ("prompt",),
    "completion": ("completion", "response"),
    "completion_ids": ("completion_ids",),
    "prompt_ids": ("prompt_ids",),
    "ground_truth": ("ground_truth", "reward_model.ground_truth"),
    "data_source": ("data_source",),
}
CHUNK = 64  # rows per scoring call, so long files show progress
# RewardComponentConfig field -> the option that sets it (for error messages)
_OPTION = {"fn": "FN", "timeout_s": "--timeout", "kwargs": "--kwarg", "num_workers": "--workers",
           "breaker_after": "--breaker-after"}


class InputError(ValueError):
    """Bad user input: reported on stderr, exit code 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = actions.add_parser(
        "test",
        help="Score JSONL rows with a reward function and print a table.",
        description="Score JSONL rows with a reward function and print a table.",
    )
    p.add_argument("fn", metavar="FN", help="'pkg.module:fn', a @reward name, or a 'beamrl.rewards' entry point")
    p.add_argument("--data", required=True, type=Path, metavar="FILE.jsonl", help="rows to score")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="score only the first N rows")
    p.add_argument(
        "--field-map",
        action="append",
        default=[],
        metavar="FIELD=PATH",
        help="take FIELD (prompt, completion, ground_truth, ...) from the row's (dotted) PATH; repeatable",
    )
    p.add_argument(
        "--kwarg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra keyword argument for the function (VALUE parsed as JSON when it can be); repeatable",
    )
    p.add_argument("--timeout", type=float, default=10.0, metavar="S", help="per-call timeout in seconds (default 10)")
    p.add_argument("--workers", type=int, default=1, metavar="N", help="reward worker processes (default 1)")
    p.add_argument(
        "--breaker-after",
        type=int,
        default=3,
        metavar="N",
        help="skip the rest of a chunk of 64 rows after N consecutive timeouts or crashes (default 3; 0: never)",
    )


def _parse_pairs(items: list[str], option: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise InputError(f"{option} {item!r} must look like NAME=VALUE")
        out[key.strip()] = value.strip()
    return out


def parse_field_map(items: list[str]) -> dict[str, str]:
    from beamrl.rewards import FIELDS

    mapping = _parse_pairs(items, "--field-map")
    bad = sorted(set(mapping) - set(FIELDS))
    if bad:
        raise InputError(f"--field-map: unknown field(s) {bad}; fields: {', '.join(FIELDS)}")
    return mapping


def parse_kwargs(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, raw in _parse_pairs(items, "--kwarg").items():
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def read_rows(path: Path, limit: int | None) -> list[tuple[int, dict]]:
    """(line number, row) pairs; InputError naming the file and line for anything unreadable."""
    if not path.is_file():
        raise InputError(f"--data file {str(path)!r} does not exist")
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path} line {lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise InputError(f"{path} line {lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append((lineno, row))
    if not rows:
        raise InputError(f"{path} has no rows")
    return rows


_MISSING = object()


def _lookup(row: dict, path: str) -> Any:
    node: Any = row
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def row_to_sample(row: dict, field_map: dict[str, str], required: tuple[str, ...], where: str):
    """Build a RewardSample; InputError when a field the function requires is absent."""
    from beamrl.rewards import RewardSample

    values: dict[str, Any] = {}
    used_keys: set[str] = set()
    for field, defaults in DEFAULT_PATHS.items():
        paths = (field_map[field],) if field in field_map else defaults
        for path in paths:
            value = _lookup(row, path)
            if value is not _MISSING:
                values[field] = value
                used_keys.add(path.split(".")[0])
                break
    if "metadata" in field_map:
        meta = _lookup(row, field_map["metadata"])
        if meta is _MISSING or not isinstance(meta, dict):
            raise InputError(f"{where}: --field-map metadata={field_map['metadata']} is not an object in this row")
        values["metadata"] = meta
    else:
        values["metadata"] = {k: v for k, v in row.items() if k not in used_keys}
    for field in required:
        if field not in values:
            tried = (field_map[field],) if field in field_map else DEFAULT_PATHS.get(field, ())
            raise InputError(
                f"{where}: the reward function needs field {field!r} but the row has no "
                f"{' / '.join(repr(t) for t in tried)} (map one with --field-map {field}=PATH)"
            )
    return RewardSample(**values)


def _detail(score) -> str:
    if score.message:
        return score.message.splitlines()[0][:100]
    return " ".join(f"{k}={v:g}" for k, v in score.metrics.items())


def run_test(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from beamrl.rewards import RewardComponentConfig, RewardLoadError, RewardManager, load_reward_fn
    from beamrl.rewards.loading import importable_working_directory

    if args.limit is not None and args.limit < 1:
        raise InputError(f"--limit {args.limit} must be >= 1")
    if args.workers < 1:
        raise InputError(f"--workers {args.workers} must be >= 1")
    field_map = parse_field_map(args.field_map)
    kwargs = parse_kwargs(args.kwarg)
    importable_working_directory()  # "my_module:fn" in the current directory, exactly as `beamrl train` finds it
    try:
        component = RewardComponentConfig(
            name="reward",
            fn=args.fn,
            timeout_s=args.timeout,
            on_error="skip",
            kwargs=kwargs,
            num_workers=args.workers,
            breaker_after=args.breaker_after,
        )
        fn = load_reward_fn(component.fn, component.kwargs)
    except ValidationError as e:  # name the option, not the config field
        raise InputError("; ".join(f"{_OPTION.get(str(x['loc'][0]), x['loc'][0])}: {x['msg']}" for x in e.errors()))
    except (RewardLoadError, ValueError) as e:
        raise InputError(str(e)) from None
    rows = read_rows(args.data, args.limit)
    samples = [row_to_sample(row, field_map, fn.required, f"{args.data} line {ln}") for ln, row in rows]

    t0 = time.monotonic()
    scores = []
    with RewardManager([component]) as manager:
        for start in range(0, len(samples), CHUNK):
            result = manager.score(samples[start : start + CHUNK])
            scores.extend(result.components["reward"])
            if len(samples) > CHUNK:
                print(f"scored {len(scores)}/{len(samples)} rows", file=sys.stderr, flush=True)
    wall = time.monotonic() - t0

    print(f"{'row':>5} {'line':>6} {'score':>10} {'status':<8} {'ms':>9}  detail")
    for i, ((lineno, _), s) in enumerate(zip(rows, scores, strict=True)):
        shown = "-" if s.score is None else f"{s.score:.4f}"
        print(f"{i:>5} {lineno:>6} {shown:>10} {s.status:<8} {s.elapsed_s * 1e3:>9.1f}  {_detail(s)}")
    values = [s.score for s in scores if s.score is not None]
    count = {st: sum(s.status == st for s in scores) for st in ("ok", "none", "error", "timeout", "crash", "skipped")}
    times = [s.elapsed_s * 1e3 for s in scores]
    mean = f"{sum(values) / len(values):.4f}" if values else "n/a"
    print(
        f"\n{fn.spec}: rows {len(scores)}, scored {count['ok']}, not applicable {count['none']}, "
        f"errors {count['error']}, timeouts {count['timeout']}, crashes {count['crash']}, skipped {count['skipped']}; "
        f"mean score {mean}"
    )
    print(
        f"time: {wall:.2f} s wall (incl. worker start), per call mean {sum(times) / len(times):.1f} ms, max {max(times):.1f} ms"
    )
    failures = [(i, s) for i, s in enumerate(scores) if s.failed]
    for i, s in failures[:5]:
        print(f"\nrow {i} {s.status}: {s.message}", file=sys.stderr)
    return 1 if failures else 0


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "test":
            return run_test(args)
    except InputError as e:
        print(f"beamrl reward {args.action}: error: {e}", file=sys.stderr)
        return 2
    raise AssertionError(f"unhandled action {args.action!r}")

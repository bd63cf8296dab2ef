"""SGLang 0.5.23's own command-line parser, asked about `server_args`: how a recipe value becomes arguments of
`python -m sglang.launch_server`, and which value SGLang makes of them.

A recipe's `rollout.server_args` are SGLang options beamrl does not model, keyed by their `ServerArgs` field names
(what the in-process `sglang.Engine` takes). Values have no one spelling on SGLang's command line: a flag that
stores a constant can only say that constant (or nothing, which leaves the default); a `--x/--no-x` pair says
either; a list option either takes its items as separate arguments (`--cuda-graph-bs-decode 1 2 4`) or one JSON
list; a dict option takes a JSON string. `render` asks SGLang's parser which, and refuses a value the command line
cannot say. `parse` gives the value SGLang's command line makes of it, which the in-process engine is given too, so
both launch paths hand SGLang the same value. `check` runs at recipe load and names the key that is not a field
name (an unknown option, or another spelling of one: `tensor_parallel_size` for `tp_size`) or whose value
SGLang's parser refuses.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import Any


class _Refused(ValueError):
    """SGLang's parser refused an argument (its own message)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # raise instead of printing the usage and exiting
        raise _Refused(message)


@functools.lru_cache(maxsize=1)
def _sglang_parser() -> tuple[_Parser, dict[str, argparse.Action], dict[str, argparse.Action]]:
    """SGLang's parser, its actions by field name (dest) and by option string."""
    fresh = "sglang" not in sys.modules
    environ = dict(os.environ)
    try:
        from sglang.srt.server_args import ServerArgs
    except Exception as e:  # noqa: BLE001 - missing, or a native library that fails to load: named, not a traceback
        raise ValueError(f"SGLang 0.5.23 is not importable here ({type(e).__name__}: {e}); its parser checks "
                         "server_args") from None
    finally:
        if fresh:  # importing sglang sets cache-folder defaults (TRITON_CACHE_DIR, ...): a check must not change
            _restore(environ)  # this process's environment, which Ray's processes started later inherit
    parser = _Parser(allow_abbrev=False, add_help=False)
    ServerArgs.add_cli_args(parser)
    by_dest: dict[str, argparse.Action] = {}
    for a in parser._actions:
        by_dest.setdefault(a.dest, a)
    return parser, by_dest, {o: a for a in parser._actions for o in a.option_strings}


def _restore(environ: dict[str, str]) -> None:
    """Undo the changes to `os.environ` since `environ` was taken (key by key: other threads never see it empty)."""
    for key in [k for k in os.environ if k not in environ]:
        del os.environ[key]
    for key, value in environ.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def action_for(key: str) -> argparse.Action:
    """SGLang's option whose field name is `key`; `ValueError` for an unknown key or another spelling of a field
    (`tensor_parallel_size`, `model`, `ep`): the field name is the one key the in-process engine takes, and the one
    beamrl's own checks (placement, first-class fields) look at."""
    _, by_dest, by_flag = _sglang_parser()
    if key in by_dest:
        return by_dest[key]
    other = by_flag.get(flag(key))
    if other is not None:
        raise ValueError(f"{flag(key)} is SGLang's other spelling of its field {other.dest!r}: write {other.dest}")
    raise ValueError(f"{flag(key)} is not an SGLang 0.5.23 server argument")


def _option(action: argparse.Action) -> str:
    return flag(action.dest) if flag(action.dest) in action.option_strings else action.option_strings[0]


def _item(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (dict, list, tuple)) else str(v)


def render(key: str, value: Any) -> list[str]:
    """The arguments `key=value` becomes on SGLang's command line; `ValueError` naming why where it cannot say the
    value (False for a flag whose default is None, ...)."""
    action = action_for(key)
    option = _option(action)
    if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x
        if isinstance(value, bool):
            return [option] if value else ["--no-" + option[2:]]
        if value is None and action.default is None:
            return []
        raise ValueError(f"{option} takes true or false (leaving it out gives its default, {action.default!r})")
    if action.nargs == 0:  # a flag that stores its constant
        if value is action.const or value == action.const and type(value) is type(action.const):
            return [option]
        if value is action.default or value == action.default and type(value) is type(action.default):
            return []
        raise ValueError(f"{option} can only set {action.const!r} (its default is {action.default!r}): "
                         f"{value!r} cannot be said on SGLang's command line")
    if value is None:
        if action.default is None:
            return []
        raise ValueError(f"None cannot be said on SGLang's command line (the default is {action.default!r}): "
                         "leave the key out")
    if isinstance(value, bool) and not (action.choices and value in action.choices):
        raise ValueError(f"{option} takes a value, not {value!r} (it would arrive as the string {str(value)!r})")
    if isinstance(value, (list, tuple)) and action.nargs in ("+", "*"):
        return [option, *(_item(v) for v in value)]
    return [option, _item(value)]


def parse(key: str, value: Any) -> Any:
    """The value SGLang's command line makes of `key=value`; `ValueError` naming why if it cannot say it or its
    parser refuses it."""
    parser, _, _ = _sglang_parser()
    action = action_for(key)
    try:
        ns = parser.parse_args(["--model-path", "unused", *render(key, value)])
    except _Refused as e:
        raise ValueError(f"SGLang's parser refuses it: {e}") from None
    return getattr(ns, action.dest)


def check(server_args: dict[str, Any]) -> None:
    """`ConfigError` naming `server_args.<key>` for the first key SGLang's parser does not take."""
    from beamrl.config import ConfigError

    for key, value in server_args.items():
        try:
            parse(key, value)
        except ValueError as e:
            raise ConfigError(f"server_args.{key}", value, str(e)) from None

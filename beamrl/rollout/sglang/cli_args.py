"""SGLang 0.5.23's own command-line parser, asked about `server_args`: how a recipe value becomes arguments of
`python -m sglang.launch_server`, and which value SGLang makes of them.

A recipe's `rollout.server_args` are SGLang options beamrl does not model. Scalars pass as they are, but lists and
dicts have no one spelling: a list option of SGLang's either takes its items as separate arguments
(`--cuda-graph-bs-decode 1 2 4`) or one JSON list; a dict option takes a JSON string. `render` asks SGLang's parser
which; `parse` gives the value SGLang's command line makes of it, which the in-process engine is given too, so both
launch paths hand SGLang the same value; `check` runs at recipe load and names the key SGLang does not know or whose
value its parser refuses.
"""

from __future__ import annotations

import argparse
import functools
import json
from typing import Any


class _Refused(ValueError):
    """SGLang's parser refused an argument (its own message)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # raise instead of printing the usage and exiting
        raise _Refused(message)


@functools.lru_cache(maxsize=1)
def _sglang_parser() -> tuple[_Parser, dict[str, argparse.Action]]:
    from sglang.srt.server_args import ServerArgs

    parser = _Parser(allow_abbrev=False, add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser, {flag: a for a in parser._actions for flag in a.option_strings}


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def render(key: str, value: Any) -> list[str]:
    """The arguments `key=value` becomes on SGLang's command line (`True`: a bare flag; `False`/None: nothing)."""
    if isinstance(value, bool):
        return [flag(key)] if value else []
    if value is None:
        return []
    if isinstance(value, (list, tuple, dict)):
        action = _sglang_parser()[1].get(flag(key))
        if not isinstance(value, dict) and action is not None and action.nargs in ("+", "*"):
            return [flag(key), *(str(v) for v in value)]
        return [flag(key), json.dumps(value)]
    return [flag(key), str(value)]


def parse(key: str, value: Any) -> Any:
    """The value SGLang's command line makes of `key=value`; `ValueError` naming the key if its parser refuses."""
    parser, actions = _sglang_parser()
    action = actions.get(flag(key))
    if action is None:
        raise ValueError(f"{flag(key)} is not an SGLang 0.5.23 server argument")
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

"""The `beamrl` command line: a thin dispatcher over `beamrl.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys

from beamrl.commands import COMMANDS, command_module


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of the command `only` alone (its module is the only one imported, so
    `beamrl train` prints its first line before torch is loaded)."""
    parser = argparse.ArgumentParser(prog="beamrl", description="RL post-training for the Beam MoE.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMANDS if only is None else [only]:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name == module_name:  # command not written yet
                continue
            raise
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(command_module(argv[0]) if argv else None)
    args, extra = parser.parse_known_args(argv)
    # argparse cannot put positionals after an option ("train R --dry-run a=b"): trailing key=value
    # words go to a command's `overrides` positional; anything else is still an error.
    if extra:
        if hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

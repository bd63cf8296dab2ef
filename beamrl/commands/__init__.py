"""Sub-commands of the `beamrl` CLI. Each module defines `NAME`, `HELP`, `add_arguments(parser)` and
`run(args) -> int`; register it in `COMMANDS` below (the order is the order of `beamrl --help`). A command's
module is named after the command (`init-checkpoint` -> `init_checkpoint`)."""

COMMANDS = [
    "beamrl.commands.init_checkpoint",
    "beamrl.commands.parity",
    "beamrl.commands.train",
    "beamrl.commands.reward",
    "beamrl.commands.bench",
]


def command_module(word: str) -> str | None:
    """The module of the command named `word`, or None (an option such as --help, or an unknown name: then the
    full parser is built and reports it)."""
    module = f"{__name__}.{word.replace('-', '_')}"
    return module if module in COMMANDS else None

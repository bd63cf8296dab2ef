"""Sub-commands of the `beamrl` CLI. Each module defines `NAME`, `HELP`, `add_arguments(parser)` and
`run(args) -> int`; register it in `COMMANDS` below (the order is the order of `beamrl --help`)."""

COMMANDS = [
    "beamrl.commands.init_checkpoint",
    "beamrl.commands.parity",
    "beamrl.commands.train",
    "beamrl.commands.reward",
    "beamrl.commands.bench",
]

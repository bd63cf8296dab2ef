"""One progress line on stdout, prefixed `[beamrl]` (the per-step line is `beamrl.metrics.console`'s)."""


def log(msg: str) -> None:
    print(f"[beamrl] {msg}", flush=True)

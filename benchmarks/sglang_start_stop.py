"""Start and shut down SGLang's CPU engine on a tiny random Beam checkpoint, timed: in-process (`SGLangEngine`) and,
with `--http`, the server (`SGLangHTTPEngine`). Prints a table; times on a shared machine are indicative.

    TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/sglang_start_stop.py [--http] [--repeat 2]

(`TORCHDYNAMO_DISABLE=1` as the test suite runs it: without it SGLang's scheduler compiles its grouped top-k with
inductor on the first request.)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--http", action="store_true", help="also the HTTP server engine")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args(argv)

    import torch

    from beamrl.models.beam import preset
    from beamrl.models.beam.model import BeamForCausalLM
    from beamrl.rollout.sglang.config import SGLangEngineConfig
    from beamrl.rollout.sglang.engine import SGLangEngine
    from beamrl.rollout.sglang.http_engine import SGLangHTTPEngine

    ckpt = Path(tempfile.mkdtemp(prefix="beamrl-sgl-bench-"))
    BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=0).save_pretrained(ckpt)
    kinds = [("in-process", lambda cfg: SGLangEngine(cfg, start_timeout=600))]
    if args.http:
        kinds.append(("http server", lambda cfg: SGLangHTTPEngine.launch(cfg, start_timeout=600)))
    print("| engine | run | start s | shutdown s |\n|---|---|---|---|")
    for name, launch in kinds:
        for run in range(1, args.repeat + 1):
            t0 = time.perf_counter()
            engine = launch(SGLangEngineConfig.on_cpu(str(ckpt), dtype="float32"))
            t1 = time.perf_counter()
            engine.shutdown()
            print(f"| {name} | {run} | {t1 - t0:.1f} | {time.perf_counter() - t1:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

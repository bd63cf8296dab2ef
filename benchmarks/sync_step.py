"""One quickstart weight sync, in-process: the real Megatron trainer's export through the one orchestrator
(`WeightSync`, colocated transport) into the native engine in its own process, timed sync by sync.

The trainer (`MegatronTrainer`, the quickstart's tiny Beam, float32, one gloo rank) lives in this process, as in
the trainer actor; the engine (`NativeEngine`, hosted behind a pipe: `HostedEngine`) in a child process, as the
engine actor. What differs from a training run is the channel to the engine (a pipe instead of Ray, whose round
trips cost more) and that no train step runs between syncs (every weight is nudged instead, so each sync ships
new bytes and the probe, on the first sync and every `--probe-every`-th, compares real changes).

Per sync: wall time of `WeightSync.sync` (everything: plan, pause, begin, export, pack, send, commit, versions,
probe), CPU time of this process (the trainer's side) and of the engine's process, and `SyncReport.seconds`
(begin .. commit: what a run logs as `time/sync_s`). Medians over the unprobed syncs after `--warmup`.

    PYTHONPATH=. .venv/bin/python benchmarks/sync_step.py [--syncs 50] [--warmup 5] [--profile 20] [--json PATH]

`--profile N`: N more syncs under cProfile, the top functions by cumulative and own time. `--in-process`: the
engine in this process too (a hybrid layout: no channel at all; its CPU time is then counted in the trainer's
column). Times on a shared machine drift; compare CPU times, and before/after in the same sitting.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RECIPE = ROOT / "recipes" / "quickstart.yaml"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--syncs", type=int, default=50, help="timed syncs (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed syncs first (>= 1: the first one is probed)")
    ap.add_argument("--probe-every", type=int, default=10, help="probe cadence (the quickstart's sync.probe_every)")
    ap.add_argument("--profile", type=int, default=0, help="then N syncs under cProfile (0: none)")
    ap.add_argument("--top", type=int, default=25, help="rows of each cProfile table")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    ap.add_argument("--in-process", action="store_true", help="the engine in this process (no pipe)")
    args = ap.parse_args(argv)
    if args.syncs < 1 or args.warmup < 1 or args.probe_every < 1 or args.profile < 0:
        ap.error("--syncs, --warmup and --probe-every must be >= 1, --profile >= 0")
    return args


def build(workdir: Path, probe_every: int, in_process: bool = False):
    """The quickstart's trainer (this process), its native engine (a child process, or this one with `in_process`)
    and a `WeightSync` between them as the RL loop builds it (`beamrl.loop.weight_sync`), minus Ray."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(20000 + os.getpid() % 20000))
    import torch

    torch.set_num_threads(1)  # as in the trainer actor
    from beamrl.data.prompts import load_tokenizer
    from beamrl.data.loader import build_prompt_loader
    from beamrl.loop.setup import initial_checkpoint, model_config, trainer_setup
    from beamrl.loop.weight_sync import export_source
    from beamrl.loop.weight_update import sync_probe
    from beamrl.recipe.load import load_recipe
    from beamrl.rollout.native.config import NativeEngineConfig
    from beamrl.rollout.native.engine import NativeEngine
    from beamrl.sync.orchestrator import ProbeCheck, SyncTimeouts, WeightSync
    from beamrl.sync.process_receiver import HostedEngine
    from beamrl.sync.transports import TRANSPORTS
    from beamrl.trainer.megatron.worker import MegatronTrainer

    recipe = load_recipe(RECIPE, [f"run.output_dir={workdir}", "logging.plot_reward_curve=false"])
    model = model_config(recipe)
    ckpt = initial_checkpoint(recipe, model, workdir)
    trainer = MegatronTrainer(trainer_setup(recipe, model), hf_checkpoint=ckpt)
    engine_config = NativeEngineConfig(model_path=ckpt, dtype=recipe.model.dtype, device="cpu", name="native-0",
                                       num_threads=1)
    engine = (NativeEngine(engine_config) if in_process else
              HostedEngine(NativeEngine, (engine_config,), name="native-0", start_timeout=120))
    tokenizer = load_tokenizer(recipe.data.tokenizer, recipe.model.checkpoint)
    data = build_prompt_loader(recipe.data, recipe.rollout.prompts_per_step, tokenizer)
    probe = sync_probe(data, tokenizer, recipe.model.dtype, recipe.rollout.engine)
    sync = WeightSync(lambda recs: TRANSPORTS.get("colocated")(recs, device="cpu"), [engine],
                      bucket_bytes=recipe.sync.bucket_bytes, timeouts=SyncTimeouts.uniform(60.0),
                      probe=ProbeCheck(probe.sequences, probe.tolerance, probe_every, probe.mean_tolerance),
                      progress=None)
    return trainer, engine, sync, (lambda: export_source(trainer))


def nudge_(trainer, step: int) -> None:
    """Stand-in for a train step: every weight changes a little (outside the timed region)."""
    import torch

    with torch.no_grad():
        for chunk in trainer.models:
            for p in chunk.parameters():
                p.mul_(1.0 + 1e-4 * ((step % 7) - 3))


def run(args: argparse.Namespace) -> dict:
    import torch

    from benchmarks._proc_cpu import process_cpu_ns

    with tempfile.TemporaryDirectory(prefix="beamrl-sync-step-") as tmp:
        trainer, engine, sync, source = build(Path(tmp), args.probe_every, args.in_process)
        engine_pid = None if args.in_process else engine.process.pid
        try:
            rows = []
            for i in range(args.warmup + args.syncs):
                nudge_(trainer, i)
                cpu0, t0 = time.process_time(), time.perf_counter()
                eng0 = process_cpu_ns(engine_pid) if engine_pid is not None else 0
                report = sync.sync(source())
                wall = time.perf_counter() - t0
                rows.append({"sync": i + 1, "probed": report.verified, "wall_ms": wall * 1e3,
                             "trainer_cpu_ms": (time.process_time() - cpu0) * 1e3,
                             "engine_cpu_ms": ((process_cpu_ns(engine_pid) - eng0) / 1e6 if engine_pid is not None
                                               else 0.0),
                             "report_ms": report.seconds * 1e3, "bytes": report.bytes, "buckets": report.buckets})
            timed = [r for r in rows[args.warmup:] if not r["probed"]]
            probed = [r for r in rows[args.warmup:] if r["probed"]]
            keys = ("wall_ms", "trainer_cpu_ms", "engine_cpu_ms", "report_ms")
            result = {"syncs": len(timed), "probed_syncs": len(probed), "bytes": rows[-1]["bytes"],
                      "buckets": rows[-1]["buckets"],
                      "median": {k: statistics.median(r[k] for r in timed) for k in keys},
                      "p10": {k: _quantile([r[k] for r in timed], 0.1) for k in keys},
                      "p90": {k: _quantile([r[k] for r in timed], 0.9) for k in keys},
                      "probed_median": ({k: statistics.median(r[k] for r in probed) for k in keys} if probed else None),
                      "torch": torch.__version__, "rows": rows}
            if args.profile:
                prof = cProfile.Profile()
                for i in range(args.profile):
                    nudge_(trainer, i)
                    prof.enable()
                    sync.sync(source())
                    prof.disable()
                result["profile"] = {order: _stats(prof, order, args.top) for order in ("cumulative", "tottime")}
        finally:
            sync.close()
            engine.shutdown()
            trainer.shutdown()
    return result


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _stats(prof: cProfile.Profile, order: str, top: int) -> str:
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.strip_dirs().sort_stats(order).print_stats(top)
    return out.getvalue()


def table(result: dict) -> str:
    lines = [f"quickstart sync: {result['bytes'] / 2**20:.2f} MiB in {result['buckets']} bucket(s); "
             f"{result['syncs']} unprobed syncs timed ({result['probed_syncs']} probed ones apart)", "",
             "| per sync (ms) | median | p10 | p90 | probed, median |", "|---|---|---|---|---|"]
    names = {"wall_ms": "wall, WeightSync.sync", "trainer_cpu_ms": "CPU, trainer process",
             "engine_cpu_ms": "CPU, engine process", "report_ms": "SyncReport.seconds (time/sync_s)"}
    for k, label in names.items():
        pm = result["probed_median"]
        lines.append(f"| {label} | {result['median'][k]:.2f} | {result['p10'][k]:.2f} | {result['p90'][k]:.2f} | "
                     f"{'' if pm is None else f'{pm[k]:.2f}'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(table(result))
    for order, text in result.get("profile", {}).items():
        print(f"\n### cProfile of {args.profile} syncs, by {order}\n{text}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

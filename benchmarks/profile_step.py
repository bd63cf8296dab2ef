"""Where one quickstart step goes: CPU time per phase and per process, then the top costs inside the train step.

The quickstart (`recipes/quickstart.yaml`: the real Megatron trainer actor, the native engine actor, R3,
a checked weight sync every step, probed per `sync.probe_every`) runs for a few steps with timing proxies around the driver's actor
groups, reward manager and logger. Three parts, three tables:

1. **Phases** (the real run under Ray): per GRPO step, the wall time and the CPU time of the driver, the
   trainer actor, the engine actor and everything else (Ray daemons, reward workers) in each phase:
   rollout, rewards, train, sync (which includes the post-sync probe check: it runs inside the trainer's
   sync call; where the last train step's call carries the sync, `TrainerGroup.train_step_then_sync`, the
   synchronous loop's case, the sync is counted in train), verify (the driver's other logprob calls), other (driver work
   between the calls: packing, advantages, metrics). Medians over the steps after the first. The SFT warm
   start gets the same row per SFT step. CPU time is what survives a loaded machine; wall time does not.
2. **Inside the train step** (a fresh process holding the same `MegatronTrainer` a trainer actor holds,
   fed the captured arguments of one GRPO and one SFT `train_step`): CPU time (min of repeats), its
   anatomy (cProfile cumulative times of forward, loss, backward, optimizer, ...), op counts (aten ops,
   autograd nodes, host reads such as `.item()`, calls into the CPU shims of `beamrl.compat.megatron_cpu`),
   the top aten ops (torch.profiler, self CPU) and the top Python functions (cProfile, own time). Also
   `compute_logprobs` of the verification probe and the weight export of a sync.
3. **Inside the engine** (a fresh process with the native engine): `generate` of the captured requests,
   `score` of the verification probe, loading one full weight update; op counts and top ops.

Plus the payloads the driver ships per step (pickled bytes, pickle + unpickle CPU time).

    PYTHONPATH=. .venv/bin/python benchmarks/profile_step.py --steps 8 --sft-steps 15 --out runs/profile_step

Writes profile.md and profile.json to --out. Op counts are exact; times on a shared machine are ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pickle
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RECIPE = ROOT / "recipes" / "quickstart.yaml"
PHASES = ("rollout", "rewards", "train", "sync", "verify", "other")
GROUPS = {"trainer": "ray::TrainerActor", "engine": "ray::EngineActor"}
CAPTURE_STEP = 2  # GRPO step whose train_step / generate arguments are captured (after warm-up)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="GRPO steps of the profiled run (>= 4)")
    ap.add_argument("--sft-steps", type=int, default=15,
                    help="SFT steps of the profiled run (>= 2; the quickstart's 15)")
    ap.add_argument("--repeats", type=int, default=7, help="repeats of each in-process measurement (min is kept)")
    ap.add_argument("--top", type=int, default=15, help="rows of the top-op and top-function tables")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "profile_step")
    ap.add_argument("--reuse-run", action="store_true",
                    help="skip the run: reuse the phases and captures an earlier call left in --out")
    ap.add_argument("--internals", choices=("trainer", "engine"), help=argparse.SUPPRESS)  # subprocess parts
    args = ap.parse_args(argv)
    if args.steps < CAPTURE_STEP + 2 or args.sft_steps < 2 or args.repeats < 1:
        ap.error(f"--steps must be >= {CAPTURE_STEP + 2}, --sft-steps >= 2 and --repeats >= 1")
    return args


def recipe_overrides(args, out: Path) -> list[str]:
    return [f"run.num_steps={args.steps}", f"sft.steps={args.sft_steps}", f"run.output_dir={out / 'run'}",
            "logging.plot_reward_curve=false"]


# ---------------------------------------------------------------------------------------------- part 1: phases
class PhaseLog:
    """Per-step wall and per-group CPU seconds of each phase (a phase may be entered several times a step)."""

    def __init__(self, groups, num_steps: int):
        self.groups, self.num_steps = groups, num_steps
        self.steps: list[dict] = []
        self.sft_steps: list[dict] = []
        self.payloads: dict[str, dict] = {}
        self.driver_profile = cProfile.Profile(time.thread_time)  # CPU time of the driver's main thread
        self._profiling = False
        self._current: dict = defaultdict(lambda: defaultdict(float))
        self._step_start = None

    @contextlib.contextmanager
    def unprofiled(self):
        """Keeps the benchmark's own work (CPU sampling, captures) out of the driver's CPU profile."""
        if self._profiling:
            self.driver_profile.disable()
        try:
            yield
        finally:
            if self._profiling:
                self.driver_profile.enable()

    def _sample(self) -> dict[str, int]:
        with self.unprofiled():
            return self.groups.sample()

    def _refresh(self) -> None:
        with self.unprofiled():
            self.groups.refresh()

    def timed(self, phase: str, fn, *args, **kwargs):
        if self._step_start is None:  # the first step starts at its first timed call (the rollout)
            self._refresh()
            self._step_start = (time.perf_counter(), self._sample())
        s0, t0 = self._sample(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            t1, s1 = time.perf_counter(), self._sample()
            row = self._current[phase]
            row["wall"] += t1 - t0
            for g in s0:
                row[g] += (s1[g] - s0[g]) / 1e9

    def end_step(self) -> None:
        t0, s0 = self._step_start
        t1, s1 = time.perf_counter(), self._sample()
        total = {"wall": t1 - t0, **{g: (s1[g] - s0[g]) / 1e9 for g in s0}}
        phases = {p: dict(v) for p, v in self._current.items()}
        other = {k: total[k] - sum(ph.get(k, 0.0) for ph in phases.values()) for k in total}
        phases["other"] = other
        self.steps.append({"total": total, "phases": phases})
        if len(self.steps) == 1:  # the driver's own CPU profile covers the steps after the first
            self.driver_profile.enable()
            self._profiling = True
        elif len(self.steps) == self.num_steps:
            self.driver_profile.disable()
            self._profiling = False
        self._current = defaultdict(lambda: defaultdict(float))
        self._refresh()
        self._step_start = (time.perf_counter(), self._sample())  # steps are back to back

    def payload(self, name: str, obj) -> None:
        """Pickled size and pickle + unpickle CPU time of one object the driver ships to or gets from an actor."""
        t0 = time.thread_time()
        blob = pickle.dumps(obj, protocol=5)
        pickle.loads(blob)
        self.payloads[name] = {"bytes": len(blob), "cpu_ms": (time.thread_time() - t0) * 1e3}


class _Timed:
    """Forwards every attribute to `target`; the methods named in `phases` are timed (and maybe captured)."""

    def __init__(self, target, log: PhaseLog, phases: dict[str, str], on_call=None):
        self._target, self._log, self._phases, self._on_call = target, log, phases, on_call

    def __getattr__(self, name):
        attr = getattr(self._target, name)
        if name not in self._phases or not callable(attr):
            return attr

        def call(*args, **kwargs):
            if self._on_call is not None:
                with self._log.unprofiled():
                    self._on_call(name, args, kwargs)
            out = self._log.timed(self._phases[name], attr, *args, **kwargs)
            if self._on_call is not None:
                with self._log.unprofiled():
                    self._on_call(name + ":result", (out,), {})
            return out

        return call


def make_driver_class():
    from beamrl.loop.driver import RLDriver

    class ProfiledDriver(RLDriver):
        """The quickstart driver with timing proxies around its trainer, engines, reward manager and logger (set
        as attributes of the driver and of its `RunContext`)."""

        def __init__(self, recipe, log: PhaseLog, capture_dir: Path):
            self._plog, self._capture_dir, self._grpo_step = log, capture_dir, 0
            super().__init__(recipe)

        def __setattr__(self, name, value):
            if name in ("engines", "trainer", "reference", "ctx") and value is not None:
                log = self._plog
                if name == "engines":
                    value = _Timed(value, log, {"generate_async": "rollout", "collect": "rollout",
                                                "generate": "rollout", "score": "verify", "versions": "sync",
                                                "call_all": "sync"}, self._engine_call)
                elif name in ("trainer", "reference"):
                    value = _Timed(value, log, {"train_step": "train", "train_step_then_sync": "train",
                                                "sync_weights": "sync",
                                                "compute_logprobs": "verify"}, self._trainer_call)
                elif name == "ctx":  # the run's reward manager and metrics logger live in its RunContext
                    value.rewards = _Timed(value.rewards, log, {"score": "rewards"})
                    value.logger = _LoggerProxy(value.logger, self)
            super().__setattr__(name, value)

        def _capturing(self) -> bool:
            return self._grpo_step == CAPTURE_STEP

        def _trainer_call(self, name, args, kwargs):
            if name == "train_step_then_sync" and self._capturing():  # (micro, loss_fn, replay, temperature, ...)
                self._trainer_call("train_step", args[:2], {"replay": args[2], "temperature": args[3]})
                self._trainer_call("sync_weights", args[4:], {})
            elif name == "train_step" and self._capturing():
                self._plog.payload("train_step arguments (driver -> trainer)", (args, kwargs))
                _dump(self._capture_dir / "grpo_train_step.pkl", (args, kwargs))
            elif name == "sync_weights" and self._capturing():
                # The post-sync probe runs inside the trainer's sync (docs/weight-sync.md): take its sequences
                # from the sync request, for the trainer-side and engine-side costs measured below.
                from beamrl.trainer.protocol import PackedBatch

                request = kwargs["request"] if "request" in kwargs else args[1]
                seqs = [list(s) for s in request.probe_sequences]
                if seqs:
                    _dump(self._capture_dir / "probe_batch.pkl", PackedBatch.from_sequences(seqs))
                    _dump(self._capture_dir / "probe_sequences.pkl", seqs)
            elif name == "train_step:result" and self._capturing():
                self._plog.payload("train_step result (trainer -> driver)", args[0])
            elif name == "train_step_then_sync:result" and self._capturing():  # (result, CarriedSync)
                self._plog.payload("train_step result (trainer -> driver)", args[0][0])

        def _engine_call(self, name, args, kwargs):
            if name == "generate_async" and self._capturing():
                self._plog.payload("generate requests (driver -> engine)", args[0])
                _dump(self._capture_dir / "generate_requests.pkl", args[0])
            elif name == "collect:result" and self._capturing():
                self._plog.payload("generate results (engine -> driver)", args[0])


    class _LoggerProxy:
        def __init__(self, logger, driver):
            self._logger, self._driver = logger, driver

        def __getattr__(self, name):
            return getattr(self._logger, name)

        def log(self, step, metrics):
            out = self._logger.log(step, metrics)
            self._driver._plog.end_step()
            self._driver._grpo_step += 1
            return out

    return ProfiledDriver


class SftLineClock(io.TextIOBase):
    """Tees the driver's stdout and samples CPU at each 'SFT step i/n' progress line: the SFT loop has no other
    seam (its trainer is local to `loop.sft`). Per-step values are the intervals between two lines divided by
    the steps between them, so the first step (lazy set-up) is left out."""

    _LINE = re.compile(r"SFT step (\d+)/\d+: nll")

    def __init__(self, stream, log: PhaseLog):
        self.stream, self.log, self.last = stream, log, None

    def write(self, text: str) -> int:
        m = self._LINE.search(text) if threading.current_thread() is threading.main_thread() else None
        if m is not None:
            if self.last is None:  # the SFT trainer actor exists by now; keep one membership for all intervals
                self.log._refresh()
            now = (int(m.group(1)), time.perf_counter(), self.log._sample())
            if self.last is not None:
                (i0, t0, s0), (i1, t1, s1) = self.last, now
                n = i1 - i0
                self.log.sft_steps.append({"wall": (t1 - t0) / n, **{g: (s1[g] - s0[g]) / 1e9 / n for g in s0}})
            self.last = now
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def _dump(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(obj, protocol=5))


def load_capture(out: Path, name: str):
    """One object this script pickled into `<out>/capture/` (its own bytes: never point this at others' files)."""
    return pickle.loads((out / "capture" / f"{name}.pkl").read_bytes())


def captured_trainer(args, out: Path):
    """The trainer an actor holds, built in this process (one thread) from a capture run, and the captured GRPO
    `train_step` arguments: `(recipe, trainer, (args, kwargs))`."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(20000 + os.getpid() % 20000))
    import torch

    torch.set_num_threads(1)  # as in the trainer actor
    from beamrl.loop.setup import trainer_setup
    from beamrl.trainer.megatron.worker import MegatronTrainer

    recipe, model = _recipe_and_model(args, out)
    trainer = MegatronTrainer(trainer_setup(recipe, model), hf_checkpoint=str(out / "run" / "sft_checkpoint"))
    return recipe, trainer, load_capture(out, "grpo_train_step")


def run_phases(args, out: Path) -> dict:
    from beamrl.recipe.load import load_recipe

    from benchmarks._proc_cpu import ProcessGroups

    recipe = load_recipe(RECIPE, recipe_overrides(args, out))
    shutil.rmtree(out / "run", ignore_errors=True)  # a fresh run: the SFT warm start must not be reused
    log = PhaseLog(ProcessGroups(GROUPS), args.steps)
    driver_cls = make_driver_class()
    stdout, sys.stdout = sys.stdout, SftLineClock(sys.stdout, log)
    try:
        with driver_cls(recipe, log, out / "capture") as driver:
            driver.run()
    finally:
        sys.stdout = stdout
    if len(log.steps) != args.steps or not log.sft_steps:
        raise RuntimeError(f"profiled {len(log.steps)} GRPO steps and {len(log.sft_steps)} SFT intervals, expected "
                           f"{args.steps} and at least 1: did the driver's seams (attributes trainer, engines, ctx; "
                           f"the SFT progress line) move?")
    driver = profile_stats(log.driver_profile, args.top)
    n = len(log.steps) - 1
    driver["per_step"] = {k: v / n for k, v in (("profiled_ms", driver["profiled_ms"]),)}
    for row in driver["top"] + driver["beamrl_cumulative"]:
        row["own_ms"] /= n
        row["cum_ms"] /= n
        row["calls"] /= n
    return {"steps": log.steps, "sft_steps": log.sft_steps, "payloads": log.payloads,
            "groups": log.groups.groups, "driver": driver}


def phase_table(result: dict) -> str:
    """Median over steps after the first, seconds: wall and CPU per process group, per phase."""
    groups = result["groups"]
    steps = result["steps"][1:]
    cols = ["wall", *groups]
    rows = []
    for phase in PHASES:
        vals = [statistics.median(s["phases"].get(phase, {}).get(c, 0.0) for s in steps) for c in cols]
        rows.append([phase, *vals, sum(vals[1:])])
    rows.append(["**step**", *[statistics.median(s["total"][c] for s in steps) for c in cols],
                 statistics.median(sum(s["total"][g] for g in groups) for s in steps)])
    sft = result["sft_steps"]
    rows.append(["SFT step", *[statistics.median(s[c] for s in sft) for c in cols],
                 statistics.median(sum(s[g] for g in groups) for s in sft)])
    head = ["phase", "wall s", *[f"CPU s {g}" for g in groups], "CPU s all"]
    return _md(head, [[r[0], *[f"{v:.3f}" for v in r[1:]]] for r in rows])


def driver_table(result: dict) -> str:
    d = result["driver"]
    return (f"**Driver main thread** (cProfile with a CPU clock, per step: {d['per_step']['profiled_ms']:.1f} ms; "
            f"top functions by own time)\n\n" + _md(
                ["function", "calls", "own ms", "cumulative ms"],
                [[f"`{t['function']}`", f"{t['calls']:.0f}", f"{t['own_ms']:.2f}", f"{t['cum_ms']:.2f}"]
                 for t in d["top"]])
            + "\n\n**Driver main thread: beamrl functions by cumulative CPU** (per step; includes the time "
              "spent in the Ray calls they make)\n\n" + _md(
                ["function", "calls", "own ms", "cumulative ms"],
                [[f"`{t['function']}`", f"{t['calls']:.0f}", f"{t['own_ms']:.2f}", f"{t['cum_ms']:.2f}"]
                 for t in d["beamrl_cumulative"]]))


def payload_table(result: dict, trainer: dict) -> str:
    payloads = {**result["payloads"], "SFT train_step arguments (driver -> trainer)": trainer["sft_payload"]}
    rows = [[k, f"{v['bytes'] / 1024:.1f}", f"{v['cpu_ms']:.2f}"] for k, v in payloads.items()]
    return _md(["payload (one step)", "KiB pickled", "pickle + unpickle CPU ms"], rows)


# ------------------------------------------------------------------------------- parts 2 and 3: in-process
def cpu_min_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append((time.thread_time() - t0) * 1e3)
    return min(times)


def op_profile(fn, top: int) -> dict:
    """torch.profiler (CPU) of one call: aten op count, autograd nodes, host reads and the top ops."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ev = prof.key_averages()
    aten = [e for e in ev if e.key.startswith("aten::")]
    total_self = sum(e.self_cpu_time_total for e in aten) or 1.0
    tops = sorted(aten, key=lambda e: -e.self_cpu_time_total)[:top]
    return {
        "aten_ops": sum(e.count for e in aten),
        "autograd_nodes": sum(e.count for e in ev if e.key.startswith("autograd::engine::evaluate_function")),
        "host_reads": sum(e.count for e in ev if e.key == "aten::_local_scalar_dense"),
        "top": [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3,
                 "share": e.self_cpu_time_total / total_self} for e in tops]}


# (label, filename suffix, function name) of the train step's parts, for the cProfile anatomy.
ANATOMY = [
    ("train_step (total)", "trainer/megatron/worker.py", "train_step"),
    ("  prepare micro-batches", "trainer/megatron/train_step.py", "prepare"),
    ("  Megatron schedule", "megatron/core/pipeline_parallel/schedules.py", "forward_backward_no_pipelining"),
    ("    model forward", "trainer/megatron/train_step.py", "_forward_step"),
    ("    logprobs + loss", "trainer/megatron/train_step.py", "_loss_func"),
    ("    backward", "~", "<method 'run_backward' of 'torch._C._EngineBase' objects>"),
    ("    finalize grads (DP reduce)", "megatron/core/distributed/finalize_model_grads.py", "finalize_model_grads"),
    ("  reduce metrics", "trainer/megatron/worker.py", "_reduce_collected"),
    ("  optimizer step (clip + Adam)", "trainer/megatron/worker.py", "optimizer_step"),
]
_COMPAT_FILE = "beamrl/compat/megatron_cpu.py"


def python_profile(fn, top: int) -> dict:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    return profile_stats(prof, top)


def profile_stats(prof: cProfile.Profile, top: int) -> dict:
    """Anatomy of a train step (when it ran), calls into the CPU shims and the top functions by own time."""
    stats = pstats.Stats(prof)
    raw = stats.stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    total = sum(v[2] for v in raw.values())

    def find(suffix, name):
        hits = [v for (f, _, n), v in raw.items() if n == name and f.endswith(suffix)]
        return (sum(h[3] for h in hits), sum(h[1] for h in hits)) if hits else (0.0, 0)

    anatomy = [{"part": label, "cum_ms": find(sfx, name)[0] * 1e3, "calls": find(sfx, name)[1]}
               for label, sfx, name in ANATOMY]
    tops = sorted(raw.items(), key=lambda kv: -kv[1][2])[:top]
    ours = sorted(((k, v) for k, v in raw.items() if "/beamrl/" in k[0] and "/compat/" not in k[0]),
                  key=lambda kv: -kv[1][3])[:top]
    return {"profiled_ms": total * 1e3, "anatomy": anatomy,
            "beamrl_cumulative": [{"function": _fn_name(k), "calls": v[1], "own_ms": v[2] * 1e3,
                                   "cum_ms": v[3] * 1e3} for k, v in ours],
            "compat_calls": sum(v[1] for (f, _, _), v in raw.items() if f.endswith(_COMPAT_FILE)),
            "python_calls": sum(v[1] for v in raw.values()),
            "top": [{"function": _fn_name(k), "calls": v[1], "own_ms": v[2] * 1e3, "cum_ms": v[3] * 1e3}
                    for k, v in tops]}


def _fn_name(key) -> str:
    f, line, name = key
    if f == "~":
        return name
    for marker in ("site-packages/", str(ROOT) + "/"):
        if marker in f:
            f = f.split(marker, 1)[1]
    return f"{f}:{line}({name})"


def _recipe_and_model(args, out: Path):
    from beamrl.loop.setup import model_config
    from beamrl.recipe.load import load_recipe

    recipe = load_recipe(RECIPE, recipe_overrides(args, out))
    return recipe, model_config(recipe)


def _sft_capture(recipe, dp_size: int):
    """The second SFT step's batches and loss, built by the warm start's own code (`loop.sft`)."""
    from beamrl.data.loader import build_prompt_loader
    from beamrl.data.prompts import load_tokenizer
    from beamrl.loop.sft import sft_loader, sft_step_batches

    tokenizer = load_tokenizer(recipe.data.tokenizer, recipe.model.checkpoint)
    samples = build_prompt_loader(recipe.data, recipe.rollout.prompts_per_step, tokenizer).samples
    loader = sft_loader(samples, recipe.sft.batch, recipe.run.seed)
    loader.next_batch(recipe.sft.batch)
    return sft_step_batches(loader.next_batch(recipe.sft.batch), tokenizer, dp_size, recipe.trainer.micro_batch_size)


def trainer_internals(args, out: Path) -> dict:
    recipe, trainer, (grpo_args, grpo_kwargs) = captured_trainer(args, out)
    sft_micro, sft_loss = _sft_capture(recipe, 1)
    t0 = time.thread_time()
    blob = pickle.dumps((sft_micro, sft_loss), protocol=5)
    pickle.loads(blob)
    result = {"sft_payload": {"bytes": len(blob), "cpu_ms": (time.thread_time() - t0) * 1e3}}
    calls = {"grpo": (grpo_args[0], grpo_args[1], grpo_kwargs.get("replay", True),
                      grpo_kwargs.get("temperature", 1.0)),
             "sft": (sft_micro, sft_loss, False, 1.0)}
    for kind, (micro, loss_fn, replay, temperature) in calls.items():
        trainer.set_routing_replay(replay)

        def step():
            trainer.train_step(micro, loss_fn, temperature=temperature)

        for _ in range(2):
            step()
        result[kind] = {"tokens": sum(mb.num_tokens for mb in micro),
                        "sequences": sum(mb.num_sequences for mb in micro),
                        "cpu_ms": cpu_min_ms(step, args.repeats), "ops": op_profile(step, args.top),
                        "python": python_profile(step, args.top)}
    probe = load_capture(out, "probe_batch")
    trainer.set_routing_replay(False)
    result["verify_logprobs_cpu_ms"] = cpu_min_ms(lambda: trainer.compute_logprobs(probe, 1.0), args.repeats)
    result["export_cpu_ms"] = cpu_min_ms(lambda: [u for u in trainer.export_hf()], args.repeats)
    trainer.shutdown()
    return result


def engine_internals(args, out: Path) -> dict:
    import torch

    torch.set_num_threads(1)  # as in the engine actor
    from beamrl.models.beam.checkpoint import load_checkpoint
    from beamrl.rollout.engines import EngineLaunch, engine_factory

    recipe, _ = _recipe_and_model(args, out)
    ckpt = str(out / "run" / "sft_checkpoint")
    engine = engine_factory(recipe.rollout, EngineLaunch(
        checkpoint=ckpt, dtype=recipe.model.dtype, device="cpu", seed=recipe.run.seed, name="native-0", port=30000,
        start_timeout=recipe.timeouts.generate_s, return_routed_experts=True, memory_saver=False))()
    requests = [r for g in load_capture(out, "generate_requests") for r in g]
    probe = load_capture(out, "probe_sequences")
    _, tensors = load_checkpoint(ckpt)
    named = list(tensors.items())

    def gen():
        engine.generate(requests, 120.0)

    gen()
    return {"requests": len(requests), "generate_cpu_ms": cpu_min_ms(gen, args.repeats),
            "generate_ops": op_profile(gen, args.top), "generate_python": python_profile(gen, args.top),
            "score_cpu_ms": cpu_min_ms(lambda: engine.score(probe, 60.0), args.repeats),
            "load_weights_cpu_ms": cpu_min_ms(lambda: engine.model.load_hf_tensors(named), args.repeats)}


def run_internals(args, out: Path, part: str) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    cmd = [sys.executable, "-m", "benchmarks.profile_step", "--internals", part, "--out", str(out),
           "--steps", str(args.steps), "--sft-steps", str(args.sft_steps), "--repeats", str(args.repeats),
           "--top", str(args.top)]
    print(f"[profile] {part} internals: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{part} internals failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads((out / f"internals_{part}.json").read_text())


# ---------------------------------------------------------------------------------------------- tables
def _md(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def internals_tables(tr: dict, eng: dict) -> str:
    parts = []
    counts = []
    for kind in ("grpo", "sft"):
        k = tr[kind]
        counts.append([f"{kind.upper()} train_step ({k['sequences']} seqs, {k['tokens']} tokens)", f"{k['cpu_ms']:.1f}",
                       k["ops"]["aten_ops"], k["ops"]["autograd_nodes"], k["ops"]["host_reads"],
                       k["python"]["compat_calls"], k["python"]["python_calls"]])
    counts.append([f"engine generate ({eng['requests']} requests)", f"{eng['generate_cpu_ms']:.1f}",
                   eng["generate_ops"]["aten_ops"], "-", eng["generate_ops"]["host_reads"],
                   eng["generate_python"]["compat_calls"], eng["generate_python"]["python_calls"]])
    counts += [["verify: trainer logprobs of the probe", f"{tr['verify_logprobs_cpu_ms']:.1f}", "", "", "", "", ""],
               ["verify: engine score of the probe", f"{eng['score_cpu_ms']:.1f}", "", "", "", "", ""],
               ["sync: trainer HF export", f"{tr['export_cpu_ms']:.1f}", "", "", "", "", ""],
               ["sync: engine load of a full update", f"{eng['load_weights_cpu_ms']:.1f}", "", "", "", "", ""]]
    parts.append(_md(["call (in-process, 1 thread)", "CPU ms (min)", "aten ops", "autograd nodes", "host reads",
                      "CPU-shim calls", "Python calls"], counts))
    for kind in ("grpo", "sft"):
        k = tr[kind]
        total = k["python"]["anatomy"][0]["cum_ms"] or 1.0
        parts.append(f"**{kind.upper()} train_step anatomy** (cProfile cumulative; profiled total "
                     f"{total:.0f} ms vs {k['cpu_ms']:.0f} ms unprofiled)\n\n" + _md(
                         ["part", "ms (cProfile)", "share", "calls"],
                         [[a["part"], f"{a['cum_ms']:.1f}", f"{a['cum_ms'] / total:.0%}", a["calls"]]
                          for a in k["python"]["anatomy"]]))
    k = tr["grpo"]
    parts.append("**GRPO train_step: top aten ops** (torch.profiler, self CPU)\n\n" + _md(
        ["op", "calls", "self ms", "share"],
        [[f"`{t['op']}`", t["calls"], f"{t['self_ms']:.1f}", f"{t['share']:.0%}"] for t in k["ops"]["top"]]))
    parts.append("**GRPO train_step: top Python functions** (cProfile, own time)\n\n" + _md(
        ["function", "calls", "own ms", "cumulative ms"],
        [[f"`{t['function']}`", t["calls"], f"{t['own_ms']:.1f}", f"{t['cum_ms']:.1f}"] for t in k["python"]["top"]]))
    parts.append("**Engine generate: top aten ops** (torch.profiler, self CPU)\n\n" + _md(
        ["op", "calls", "self ms", "share"],
        [[f"`{t['op']}`", t["calls"], f"{t['self_ms']:.1f}", f"{t['share']:.0%}"]
         for t in eng["generate_ops"]["top"]]))
    return "\n\n".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    if args.internals is not None:
        fn = trainer_internals if args.internals == "trainer" else engine_internals
        (out / f"internals_{args.internals}.json").write_text(json.dumps(fn(args, out), indent=1) + "\n")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load0 = os.getloadavg()[0]
    if args.reuse_run:
        phases = json.loads((out / "phases.json").read_text())
    else:
        phases = run_phases(args, out)
        (out / "phases.json").write_text(json.dumps(phases, indent=1) + "\n")
    tr = run_internals(args, out, "trainer")
    eng = run_internals(args, out, "engine")
    load1 = os.getloadavg()[0]
    head = (f"{started}, {os.cpu_count()} CPUs, 1-min load average {load0:.1f} at the start and {load1:.1f} at "
            f"the end; {args.steps} GRPO steps (medians over steps 2..{args.steps}), {args.sft_steps} SFT steps")
    md = "\n\n".join([head, "**Phases of one step** (seconds; CPU per process group)", phase_table(phases),
                      payload_table(phases, tr), driver_table(phases), "**Inside the calls**",
                      internals_tables(tr, eng)])
    (out / "profile.md").write_text(md + "\n")
    (out / "profile.json").write_text(json.dumps({"phases": phases, "trainer": tr, "engine": eng}, indent=1) + "\n")
    print(md)
    print(f"\nwritten: {out / 'profile.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

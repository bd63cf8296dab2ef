"""TRL's GRPOTrainer vs beamrl, side by side on the quickstart task (single-digit addition, exact-match reward).

Both sides get the same budget, read from `recipes/quickstart.yaml`: the same 1000 seeded "a+b=" prompts, the
same 16-token digit vocabulary (same ids), a model of the same width, depth and total parameter count, the same
SFT warm start (steps x batch, lr, and the very batches: beamrl's loader order), then GRPO with the same prompts
in the same order, generations per step, max completion length, temperature, number of steps, lr (constant),
Adam, grad clip, eps-clip, no KL (beta=0) and seed.

- beamrl: `.venv/bin/beamrl train recipes/quickstart.yaml ...` (tiny Beam MoE, Megatron trainer actor + native
  engine actor under Ray); read back from its metrics.jsonl.
- TRL: the same file run with `--trl-worker` in `.venv-trl` (built by `bash benchmarks/trl_env.sh`; TRL needs a
  newer transformers than sglang's pin in .venv), a plain torch SFT loop, then trl.GRPOTrainer, on the model(s)
  of `--trl-model`: `qwen2`, a Qwen2ForCausalLM (hidden 64, 6 layers, 4/2 heads, FFN sized so that the total
  matches tiny Beam's), and/or `beam`, the repository's Beam reference model with beamrl's own init
  (benchmarks/trl_beam_peer.py): the same model and weights as the beamrl side.

    bash benchmarks/trl_env.sh
    .venv/bin/python benchmarks/trl_vs_beamrl.py --steps 60 --sft-steps 15 --repeat 3 --trl-model qwen2 beam \
        --out runs/trl_vs_beamrl_r3

`--beamrl-set KEY=VALUE` (repeatable) adds a recipe override to the beamrl side only, for a loop mode that does not
touch the shared budget, e.g. the one-step-off loop (`placement.mode=disaggregated placement.off_policy_steps=1
"algorithm.importance={mode: tis, cap: 2.0}" cluster.gpus_per_node=2 sync.transport=distributed`); keys of the
shared budget are refused.

Prints one table (framework | params | SFT s | GRPO s/step | reward first/last 20% | total wall s), one row per
side and run; with `--repeat N` (N runs per side, alternating) also each column's median and min-max spread and
beamrl's median GRPO step and SFT time as multiples of TRL's. Writes results.json to --out. Timings on a
shared machine are ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "quickstart.yaml"
# Qwen2 shape of the TRL side: Beam tiny's width, depth and heads; only the FFN width is solved for.
QWEN_HIDDEN, QWEN_LAYERS, QWEN_HEADS, QWEN_KV_HEADS = 64, 6, 4, 2
TRL_MODELS = ("qwen2", "beam")
_SFT_LINE = re.compile(r"SFT step (\d+)/(\d+): nll ([0-9.]+) \(([0-9.]+) s\)")


# ---------------------------------------------------------------------------------------------- pure parts
@dataclass(frozen=True)
class TaskSettings:
    """The budget both sides share (from the quickstart recipe plus the command line)."""

    steps: int
    sft_steps: int
    sft_batch: int
    sft_lr: float
    lr: float
    prompts_per_step: int
    generations: int
    max_new_tokens: int
    temperature: float
    eps_clip: float
    grad_clip: float
    seed: int
    num_samples: int
    max_operand: int
    data_seed: int
    vocab: tuple[str, ...]
    target_params: int
    threads: int
    trl_init: str = "beam"
    trl_model: str = "qwen2"
    model_seed: int = 0
    data_shuffle: bool = True
    data_shuffle_seed: int = 0
    beamrl_set: tuple[str, ...] = ()  # --beamrl-set: recipe overrides of the beamrl side only

#: Recipe sections and fields that shape the comparison (the budget `settings_from_recipe` reads, plus the batch
#: sizes, weight decay and loss that the TRL side mirrors by construction): `--beamrl-set` may not change them.
SHARED_BUDGET = ("run", "sft", "data", "model", "rewards", "trainer.lr", "trainer.grad_clip",
                 "trainer.micro_batch_size", "trainer.global_batch_size", "trainer.weight_decay",
                 "rollout.n_samples_per_prompt", "rollout.prompts_per_step", "rollout.max_new_tokens",
                 "rollout.temperature", "algorithm.eps_clip_low", "algorithm.eps_clip_high", "algorithm.advantage",
                 "algorithm.loss", "algorithm.loss_agg")


def beamrl_override(text: str) -> str:
    """One `--beamrl-set KEY=VALUE`, checked: a recipe key outside the shared budget."""
    key = text.split("=", 1)[0].strip()
    if "=" not in text or not key:
        raise argparse.ArgumentTypeError(f"--beamrl-set needs KEY=VALUE, got {text!r}")
    if any(key == b or key.startswith(b + ".") for b in SHARED_BUDGET):
        raise argparse.ArgumentTypeError(f"--beamrl-set {key}: part of the budget both sides share "
                                         f"(steps, data, model, lr, batch, sampling, loss); not per side")
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="GRPO steps on each side")
    ap.add_argument("--sft-steps", type=int, default=150, help="SFT warm-start steps on each side")
    ap.add_argument("--seed", type=int, default=None,
                    help="run.seed of both sides (sampling, SFT batch order; default: the recipe's). The init stays "
                         "model.seed's, the GRPO prompt order data.shuffle_seed's")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "trl_vs_beamrl", help="output directory")
    ap.add_argument("--skip-trl", action="store_true", help="run beamrl only")
    ap.add_argument("--skip-beamrl", action="store_true", help="run TRL only")
    ap.add_argument("--trl-python", type=Path, default=ROOT / ".venv-trl" / "bin" / "python",
                    help="python of the TRL venv (bash benchmarks/trl_env.sh builds it)")
    ap.add_argument("--trl-threads", type=int, default=1,
                    help="torch threads of the TRL process (beamrl's CPU actors get one core each)")
    ap.add_argument("--trl-init", choices=("beam", "hf"), default="beam",
                    help="TRL model init: 'beam' = beamrl's random-checkpoint rule (embeddings N(0,1), linears "
                         "N(0,1/fan_in), norms ~1), the same scheme the beamrl side starts from; 'hf' = "
                         "transformers' default (N(0,0.02)), which learns the SFT far more slowly here")
    ap.add_argument("--trl-model", nargs="+", choices=TRL_MODELS, default=["qwen2"],
                    help="model(s) of the TRL side, each a side of its own (trl-<model>, run after beamrl in every "
                         "repeat): 'qwen2' = a dense Qwen2ForCausalLM of tiny Beam's width, depth and parameter count "
                         "(--trl-init picks its init); 'beam' = the repository's Beam reference model "
                         "(beamrl.models.beam, tiny preset) with beamrl's own seeded init, i.e. the very model and "
                         "weights beamrl starts from (--trl-init does not apply)")
    ap.add_argument("--beamrl-set", type=beamrl_override, action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe override of the beamrl side only (repeatable), e.g. its one-step-off loop; keys "
                         "of the shared budget are refused")
    ap.add_argument("--timeout-s", type=float, default=1200.0, help="wall-clock limit of each side")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per framework, alternating beamrl, trl, beamrl, ... (run i goes to OUT/run<i>/); "
                         "with more than one, a summary table gives each column's median and min-max spread")
    ap.add_argument("--overwrite", action="store_true",
                    help="delete what an earlier run of this benchmark left in --out (results.json, beamrl/, trl/, "
                         "run<i>/) before starting; without it such an --out is refused")
    ap.add_argument("--trl-worker", type=Path, default=None, help=argparse.SUPPRESS)  # internal: settings json
    args = ap.parse_args(argv)
    if args.trl_worker is None:
        if args.steps < 1 or args.sft_steps < 0:
            ap.error(f"--steps must be >= 1 and --sft-steps >= 0 (got {args.steps}, {args.sft_steps})")
        if args.repeat < 1:
            ap.error(f"--repeat must be >= 1 (got {args.repeat})")
        args.trl_model = list(dict.fromkeys(args.trl_model))
        if args.skip_trl and args.skip_beamrl:
            ap.error("--skip-trl and --skip-beamrl together leave nothing to run")
    return args


def quickstart_recipe() -> dict:
    """The quickstart recipe as beamrl runs it: loaded and validated, every default filled in (a field the file
    leaves out, such as the PPO clip it refuses to set, is read at its default, as the run does)."""
    from beamrl.recipe import load_recipe

    return load_recipe(RECIPE).model_dump()


def settings_from_recipe(recipe: dict, steps: int, sft_steps: int, vocab: tuple[str, ...], target_params: int,
                         threads: int, trl_init: str = "beam", trl_model: str = "qwen2",
                         seed: int | None = None) -> TaskSettings:
    """The shared budget from a parsed quickstart recipe (`seed`, when given, replaces run.seed); a missing field
    raises KeyError naming it."""
    def get(path: str):
        node = recipe
        for key in path.split("."):
            if not isinstance(node, dict) or key not in node:
                raise KeyError(f"{RECIPE.name}: missing field {path!r}")
            node = node[key]
        return node

    if float(get("algorithm.eps_clip_low")) != float(get("algorithm.eps_clip_high")):
        raise ValueError("TRL side maps one symmetric clip; the recipe has eps_clip_low != eps_clip_high")
    return TaskSettings(
        steps=steps, sft_steps=sft_steps, sft_batch=int(get("sft.batch")), sft_lr=float(get("sft.lr")),
        lr=float(get("trainer.lr")), prompts_per_step=int(get("rollout.prompts_per_step")),
        generations=int(get("rollout.n_samples_per_prompt")), max_new_tokens=int(get("rollout.max_new_tokens")),
        temperature=float(get("rollout.temperature")), eps_clip=float(get("algorithm.eps_clip_low")),
        grad_clip=float(get("trainer.grad_clip")), seed=int(get("run.seed") if seed is None else seed),
        num_samples=int(get("data.synthetic.num_samples")), max_operand=int(get("data.synthetic.max_operand")),
        data_seed=int(get("data.synthetic.seed")), vocab=tuple(vocab), target_params=int(target_params),
        threads=threads, trl_init=trl_init, trl_model=trl_model,
        model_seed=_model_seed(recipe, get("run.seed") if seed is None else seed),
        data_shuffle=bool(get("data").get("shuffle", True)), data_shuffle_seed=int(get("data.shuffle_seed")))


def _model_seed(recipe: dict, run_seed) -> int:
    """beamrl's init seed: `model.seed`, or `run.seed` when it is absent or null (loop/setup.initial_checkpoint)."""
    seed = (recipe.get("model") or {}).get("seed")
    return int(run_seed if seed is None else seed)


def prompt_loader_order(n: int, seed: int, count: int, shuffle: bool = True) -> list[int]:
    """The first `count` sample indices that beamrl's `PromptLoader(samples, _, shuffle, seed)` hands out (epoch
    after epoch, each a `numpy.random.default_rng([seed, epoch])` permutation of the n samples). The TRL side
    feeds its SFT batches and GRPO prompts in this order, so both sides see the same batches at every step."""
    import numpy as np

    out: list[int] = []
    epoch = 0
    while len(out) < count:
        order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
        out.extend(int(i) for i in order[: count - len(out)])
        epoch += 1
    return out


def earlier_outputs(out: Path) -> list[Path]:
    """What an earlier run of this benchmark left in `out`: results.json, beamrl/, trl-<model>/ (trl/ before
    there were several TRL models) and run<i>/. Nothing else there is ours to delete."""
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir()
                  if p.name in ("results.json", "beamrl", "trl") or re.fullmatch(r"run\d+|trl-\w+", p.name))


def clear_earlier_outputs(out: Path) -> list[Path]:
    """`--overwrite`: delete `earlier_outputs(out)` (only those); returns what was deleted."""
    earlier = earlier_outputs(out)
    for p in earlier:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return earlier


def qwen2_params(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int) -> int:
    """Parameter count of an untied Qwen2ForCausalLM (q/k/v carry biases, o_proj does not)."""
    head_dim = hidden // heads
    kv = kv_heads * head_dim
    attn = (hidden * hidden + hidden) + 2 * (hidden * kv + kv) + hidden * hidden
    per_layer = attn + 3 * hidden * ffn + 2 * hidden
    return 2 * vocab * hidden + hidden + layers * per_layer


def qwen2_ffn_for(target: int, vocab: int) -> int:
    """FFN width whose Qwen2 total is closest to `target` parameters (the other shapes fixed above)."""
    base = qwen2_params(vocab, QWEN_HIDDEN, QWEN_LAYERS, QWEN_HEADS, QWEN_KV_HEADS, 0)
    return max(1, round((target - base) / (3 * QWEN_HIDDEN * QWEN_LAYERS)))


def read_metrics(path: Path) -> list[dict]:
    """Rows of a metrics.jsonl (one JSON object per line), ordered by step."""
    rows = [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]
    return sorted(rows, key=lambda r: r["step"])


def summarize(framework: str, rows: list[dict], params: int | None, sft_s: float | None,
              total_s: float | None) -> dict:
    """Table row from per-step rows with `reward/mean` and `time/step_s`.

    Steady state drops the first 10% of steps (at least one: it carries lazy set-up). The reward windows are
    the first and last 20% of steps (at least one step each), as beamrl's summary.json defines them."""
    rewards = [float(r["reward/mean"]) for r in rows if "reward/mean" in r]
    times = [float(r["time/step_s"]) for r in rows if "time/step_s" in r]
    if not rewards or not times:
        raise ValueError(f"{framework}: metrics have no 'reward/mean' or 'time/step_s' rows ({len(rows)} rows)")
    k = max(1, len(rewards) // 5)
    skip = max(1, len(times) // 10) if len(times) > 1 else 0
    return {"framework": framework, "params": params, "sft_s": sft_s, "steps": len(rewards),
            "grpo_s_per_step": statistics.median(times[skip:]), "reward_first_20pct": sum(rewards[:k]) / k,
            "reward_last_20pct": sum(rewards[-k:]) / k, "total_wall_s": total_s}


HEADERS = ["framework", "params", "SFT s", "GRPO s/step (median, steady)", "mean reward first 20%",
           "mean reward last 20%", "total wall s", "SFT final nll"]


def format_table(summaries: list[dict]) -> str:
    """Markdown table of `summarize` rows (plus `sft_final_nll` when present); missing values print as '-'."""
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for s in summaries:
        params = "-" if s["params"] is None else f"{s['params'] / 1e6:.3f} M"
        label = f"{s['framework']} run {s['run']}" if "run" in s else s["framework"]
        lines.append(f"| {label} | {params} | {f(s['sft_s'], '.1f')} | {f(s['grpo_s_per_step'], '.3f')} | "
                     f"{f(s['reward_first_20pct'], '.3f')} | {f(s['reward_last_20pct'], '.3f')} | "
                     f"{f(s['total_wall_s'], '.1f')} | {f(s.get('sft_final_nll'), '.3f')} |")
    return "\n".join(lines)


SUMMARY_COLUMNS = [("grpo_s_per_step", "GRPO s/step", ".3f"), ("sft_s", "SFT s", ".1f"),
                   ("reward_first_20pct", "reward first 20%", ".3f"), ("reward_last_20pct", "reward last 20%", ".3f"),
                   ("total_wall_s", "total wall s", ".1f")]


def aggregate(rows: list[dict]) -> dict[str, dict]:
    """{framework: {column: (median, min, max) or None, "runs": n}} over the runs of `--repeat`."""
    out: dict[str, dict] = {}
    for fw in dict.fromkeys(r["framework"] for r in rows):
        mine = [r for r in rows if r["framework"] == fw]
        out[fw] = {"runs": len(mine)}
        for key, _, _ in SUMMARY_COLUMNS:
            vals = [r[key] for r in mine if r.get(key) is not None]
            out[fw][key] = (statistics.median(vals), min(vals), max(vals)) if vals else None
    return out


def format_summary(summary: dict[str, dict]) -> str:
    """Markdown table of `aggregate`: 'median (min-max)' per column, then beamrl's median GRPO s/step and SFT s
    as multiples of TRL's when both sides ran."""
    head = ["framework", "runs", *[f"{label} median (min-max)" for _, label, _ in SUMMARY_COLUMNS]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for fw, agg in summary.items():
        cells = []
        for key, _, spec in SUMMARY_COLUMNS:
            v = agg[key]
            cells.append("-" if v is None else f"{format(v[0], spec)} ({format(v[1], spec)}-{format(v[2], spec)})")
        lines.append(f"| {fw} | {agg['runs']} | " + " | ".join(cells) + " |")
    peers = [fw for fw in summary if fw == "trl" or fw.startswith("trl-")] if "beamrl" in summary else []
    for peer in peers:
        for key, label, _ in SUMMARY_COLUMNS[:2]:
            a, b = summary["beamrl"][key], summary[peer][key]
            if a is not None and b is not None and b[0] > 0:
                lines.append(f"\nbeamrl / {peer}, median {label}: {a[0] / b[0]:.2f}x")
    return "\n".join(lines)


def parse_sft_seconds(log_text: str) -> tuple[float | None, float | None]:
    """(SFT loop seconds, final nll) from beamrl's last 'SFT step i/n: nll x (t s)' line; (None, None) if absent."""
    found = _SFT_LINE.findall(log_text)
    if not found:
        return None, None
    _, _, nll, secs = found[-1]
    return float(secs), float(nll)


# ---------------------------------------------------------------------------------------------- orchestration
class LoadSampler(threading.Thread):
    """1-minute load average every `every_s` seconds while the benchmark runs (the machine is shared)."""

    def __init__(self, every_s: float = 10.0):
        super().__init__(daemon=True)
        self.every_s, self.samples, self._done = every_s, [os.getloadavg()[0]], threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.every_s):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> dict:
        self._done.set()
        self.join(timeout=self.every_s + 1)
        return {"min": min(self.samples), "mean": statistics.fmean(self.samples), "max": max(self.samples),
                "n": len(self.samples)}


def _run_logged(cmd: list[str], log_path: Path, timeout_s: float, env: dict | None = None) -> tuple[int, float]:
    """Run cmd, echo its output with a prefix and save it to log_path; returns (exit code, wall seconds)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    tag = f"[{log_path.parent.name}]"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, start_new_session=True)
        expired = threading.Event()

        def kill() -> None:  # the side runs in its own session: this ends its Ray workers too
            expired.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        watchdog = threading.Timer(timeout_s, kill)  # fires even when the side hangs without output
        watchdog.start()
        try:
            for line in proc.stdout:  # progress output
                log.write(line)
                if "Warning" not in line and "warnings.warn" not in line:
                    print(line.rstrip() if line.startswith(tag) else f"{tag} {line.rstrip()}", flush=True)
            rc = proc.wait()
        finally:
            watchdog.cancel()
    if expired.is_set():
        print(f"{tag} killed after the {timeout_s:.0f} s limit (--timeout-s)", flush=True)
        rc = 124
    return rc, time.perf_counter() - t0


def beam_tiny_params(vocab_size: int) -> int:
    """Total parameters of the quickstart's tiny Beam (all experts counted), from the checkpoint layout."""
    import dataclasses
    import math

    from beamrl.models.beam.presets import preset
    from beamrl.models.beam.weights import expected_tensors

    cfg = dataclasses.replace(preset("tiny"), vocab_size=vocab_size)
    return sum(math.prod(spec.shape) for spec in expected_tensors(cfg).values())


def run_beamrl(s: TaskSettings, out: Path, timeout_s: float) -> dict:
    d = out / "beamrl"
    cmd = [str(ROOT / ".venv" / "bin" / "beamrl"), "train", str(RECIPE), f"run.num_steps={s.steps}",
           f"sft.steps={s.sft_steps}", f"run.seed={s.seed}", f"run.output_dir={d}", "logging.plot_reward_curve=false",
           *s.beamrl_set]
    print("beamrl:", " ".join(cmd), flush=True)
    rc, wall = _run_logged(cmd, d / "stdout.log", timeout_s)
    if rc != 0:
        tail = (d / "stdout.log").read_text().splitlines()[-15:]
        raise RuntimeError(f"beamrl exited {rc}; last lines of {d / 'stdout.log'}:\n" + "\n".join(tail))
    sft_s, sft_nll = parse_sft_seconds((d / "stdout.log").read_text())
    row = summarize("beamrl", read_metrics(d / "metrics.jsonl"), s.target_params, sft_s, wall)
    row["sft_final_nll"] = sft_nll
    return row


def run_trl(s: TaskSettings, out: Path, python: Path, timeout_s: float) -> dict:
    if not python.exists():
        raise FileNotFoundError(f"{python} not found: build the TRL venv with `bash benchmarks/trl_env.sh`")
    d = out / f"trl-{s.trl_model}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "settings.json").write_text(json.dumps(asdict(s), indent=2) + "\n")
    env = dict(os.environ, OMP_NUM_THREADS=str(s.threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    # -m from the repo root: running the file would put benchmarks/ first on sys.path, where kernels.py shadows
    # the `kernels` package that transformers imports.
    cmd = [str(python), "-m", "benchmarks.trl_vs_beamrl", "--trl-worker", str(d / "settings.json")]
    print("trl:", " ".join(cmd), flush=True)
    rc, wall = _run_logged(cmd, d / "stdout.log", timeout_s, env)
    if rc != 0:
        tail = (d / "stdout.log").read_text().splitlines()[-15:]
        raise RuntimeError(f"TRL worker exited {rc}; last lines of {d / 'stdout.log'}:\n" + "\n".join(tail))
    info = json.loads((d / "worker.json").read_text())
    row = summarize(d.name, read_metrics(d / "metrics.jsonl"), info["params"], info["sft_s"], wall)
    row["sft_final_nll"] = info["sft_final_nll"]
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trl_worker is not None:
        return trl_worker(args.trl_worker)
    args.out = args.out.resolve()
    earlier = earlier_outputs(args.out)
    if earlier and not args.overwrite:  # beamrl would refuse its old output dir, and results.json be replaced
        print(f"--out {args.out} holds an earlier run ({', '.join(p.name for p in earlier)}): pass --overwrite to "
              "delete it first, or choose another --out", file=sys.stderr)
        return 2
    clear_earlier_outputs(args.out)
    from beamrl.data.digit_tokenizer import DigitTokenizer

    vocab = DigitTokenizer.vocab
    recipe = quickstart_recipe()
    s = settings_from_recipe(recipe, args.steps, args.sft_steps, vocab, beam_tiny_params(len(vocab)),
                             args.trl_threads, args.trl_init, args.trl_model[0], args.seed)
    s = replace(s, beamrl_set=tuple(args.beamrl_set))
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = LoadSampler()
    load.start()
    rows, errors = [], {}
    for run in range(1, args.repeat + 1):  # alternating, so both sides see the same drift in machine load
        out = args.out if args.repeat == 1 else args.out / f"run{run}"
        sides = [("beamrl", args.skip_beamrl, lambda: run_beamrl(s, out, args.timeout_s))]
        sides += [(f"trl-{m}", args.skip_trl,
                   lambda m=m: run_trl(replace(s, trl_model=m), out, args.trl_python, args.timeout_s))
                  for m in args.trl_model]
        for name, skip, fn in sides:
            if skip:
                continue
            side_load = LoadSampler()
            side_load.start()
            try:
                row = fn()
                row.update(run=run, loadavg_1min=side_load.stop())
                rows.append(row)
            except (RuntimeError, FileNotFoundError, ValueError) as e:  # report the other side anyway
                side_load.stop()
                errors[f"{name} run {run}"] = str(e)
                print(f"{name} run {run} FAILED: {e}", file=sys.stderr, flush=True)
    load_stats = load.stop()
    summary = aggregate(rows) if rows else {}
    result = {"started_utc": started, "finished_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "cpu_count": os.cpu_count(),
              "loadavg_1min_during_run": load_stats, "command": " ".join([sys.executable, *sys.argv]),
              "settings": asdict(s), "trl_models": args.trl_model, "repeat": args.repeat, "rows": rows,
              "summary": summary, "errors": errors}
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{s.steps} GRPO steps x {s.prompts_per_step} prompts x {s.generations} generations, "
          f"SFT {s.sft_steps} x {s.sft_batch}; {os.cpu_count()} CPUs, 1-min load average during the run "
          f"{load_stats['min']:.1f}-{load_stats['max']:.1f} (mean {load_stats['mean']:.1f})")
    print(format_table(rows))
    if args.repeat > 1 and rows:
        print("\n" + format_summary(summary))
    print(f"results: {args.out / 'results.json'}")
    return 1 if errors else 0


# ---------------------------------------------------------------------------------------------- TRL side
def beam_style_init_(model, generator) -> None:
    """Re-draw a Qwen2 model's weights by the rule of beamrl's random Beam checkpoint (models/beam/weights.py):
    norms 1 + 0.1 N(0,1), embeddings N(0,1), every other matrix N(0, 1/fan_in); biases zero. Both sides then
    start from the same init scheme, so the SFT comparison is about the frameworks, not about init scales."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
            elif name.endswith("bias"):
                p.zero_()
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=generator))
            else:
                p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)


def trl_worker(settings_path: Path) -> int:
    """Runs inside .venv-trl: digit tokenizer, Qwen2 model, torch SFT loop, then trl.GRPOTrainer."""
    import random
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch
    from datasets import Dataset
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    raw = json.loads(Path(settings_path).read_text())
    s = TaskSettings(**{**raw, "vocab": tuple(raw["vocab"])})
    out = Path(settings_path).parent
    torch.set_num_threads(s.threads)
    random.seed(s.seed)
    torch.manual_seed(s.seed)

    # Same ids as beamrl's DigitTokenizer: every character is one token, specials first.
    eos, pad, bos = s.vocab[:3]
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(s.vocab)}, unk_token=pad))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=eos, pad_token=pad, bos_token=bos)
    assert tok("3+4=")["input_ids"] == [s.vocab.index(c) for c in "3+4="], tok("3+4=")

    # Same seeded rows as beamrl's synthetic-addition source.
    rng = random.Random(s.data_seed)
    rows = []
    for _ in range(s.num_samples):
        a, b = rng.randint(0, s.max_operand), rng.randint(0, s.max_operand)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})

    ffn, generation_kwargs = None, None
    if s.trl_model == "beam":
        from benchmarks.trl_beam_peer import beam_peer

        model = beam_peer(len(s.vocab), tok.eos_token_id, tok.pad_token_id, tok.bos_token_id, seed=s.model_seed)
        generation_kwargs = {"use_cache": False}  # the reference model's forward has no transformers cache
        params = sum(p.numel() for p in model.parameters())
        print(f"Beam reference model (tiny, vocab {len(s.vocab)}), beamrl's init at seed {s.model_seed}: "
              f"{params:,} params", flush=True)
    else:
        ffn = qwen2_ffn_for(s.target_params, len(s.vocab))
        cfg = Qwen2Config(vocab_size=len(s.vocab), hidden_size=QWEN_HIDDEN, intermediate_size=ffn,
                          num_hidden_layers=QWEN_LAYERS, num_attention_heads=QWEN_HEADS,
                          num_key_value_heads=QWEN_KV_HEADS, max_position_embeddings=64, tie_word_embeddings=False,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
        model = Qwen2ForCausalLM(cfg).float()
        if s.trl_init == "beam":
            beam_style_init_(model, torch.Generator().manual_seed(s.seed))
        params = sum(p.numel() for p in model.parameters())
        print(f"Qwen2 hidden {QWEN_HIDDEN} x {QWEN_LAYERS} layers, FFN {ffn}, {s.trl_init} init: {params:,} params "
              f"(tiny Beam: {s.target_params:,})", flush=True)

    # SFT: beamrl's warm start (prompt + answer + eos, loss on answer + eos, token mean, Adam, clip) as a plain
    # torch loop, on the very batches beamrl's warm start draws (its loader's order, seed run.seed + 1).
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=s.sft_lr)
    sft_order = prompt_loader_order(len(rows), s.seed + 1, s.sft_steps * s.sft_batch)
    t0, nll = time.perf_counter(), float("nan")
    model.train()
    for i in range(s.sft_steps):
        batch = [rows[j] for j in sft_order[i * s.sft_batch:(i + 1) * s.sft_batch]]
        seqs, masks = [], []
        for r in batch:
            p = tok(r["prompt"])["input_ids"]
            ans = tok(r["answer"])["input_ids"] + [tok.eos_token_id]
            seqs.append(p + ans)
            masks.append([0] * len(p) + [1] * len(ans))
        n = max(map(len, seqs))
        ids = torch.tensor([q + [tok.pad_token_id] * (n - len(q)) for q in seqs])
        att = torch.tensor([[1] * len(q) + [0] * (n - len(q)) for q in seqs])
        lm = torch.tensor([m + [0] * (n - len(m)) for m in masks], dtype=torch.float32)
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(lp * lm[:, 1:]).sum() / lm[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], s.grad_clip)
        opt.step()
        nll = loss.item()
        if i % max(1, s.sft_steps // 10) == 0 or i == s.sft_steps - 1:
            print(f"SFT step {i + 1}/{s.sft_steps}: nll {nll:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    sft_s = time.perf_counter() - t0

    def exact_match(completions, answer, **_):
        return [1.0 if c.strip() == a.strip() else 0.0 for c, a in zip(completions, answer)]

    class StepMetrics(TrainerCallback):
        """metrics.jsonl in beamrl's keys: one row per optimizer step (generation + update)."""

        def __init__(self):
            self.rows, self.t = [], 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.rows.append({"step": state.global_step - 1, "time/step_s": time.perf_counter() - self.t})

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs and self.rows:
                self.rows[-1]["reward/mean"] = float(logs["reward"])
                if len(self.rows) % max(1, s.steps // 10) == 0:
                    print(f"GRPO step {len(self.rows)}/{s.steps}: reward {logs['reward']:.3f}", flush=True)

    cb = StepMetrics()
    gcfg = GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        disable_tqdm=True, logging_steps=1, seed=s.seed, data_seed=s.seed, max_steps=s.steps,
        per_device_train_batch_size=s.prompts_per_step * s.generations, gradient_accumulation_steps=1,
        num_generations=s.generations, max_completion_length=s.max_new_tokens, temperature=s.temperature,
        learning_rate=s.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=s.grad_clip, beta=0.0, epsilon=s.eps_clip, num_iterations=1, loss_type="dapo",
        scale_rewards="group", optim="adamw_torch", generation_kwargs=generation_kwargs,
        # beamrl recomputes nothing (trainer.recompute: none); TRL 1.16 turns checkpointing on by default
        gradient_checkpointing=False,
        # the prompts of each step in beamrl's order (its rollout loader: data.shuffle, data.shuffle_seed)
        shuffle_dataset=False)
    grpo_rows = [rows[j] for j in prompt_loader_order(len(rows), s.data_shuffle_seed, s.steps * s.prompts_per_step,
                                                      s.data_shuffle)]
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=gcfg, processing_class=tok,
                          train_dataset=Dataset.from_list(grpo_rows), callbacks=[cb])
    trainer.remove_callback(PrinterCallback)  # its per-step dicts drown the progress lines
    trainer.train()
    with open(out / "metrics.jsonl", "w") as f:
        for r in cb.rows:
            f.write(json.dumps(r) + "\n")
    (out / "worker.json").write_text(json.dumps({"params": params, "model": s.trl_model, "ffn": ffn, "sft_s": sft_s,
                                                 "sft_final_nll": nll}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

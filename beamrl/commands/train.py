"""`beamrl train RECIPE [key=value ...] [--dry-run] [--resume | --overwrite] [--verbose]`: run (or only check) a
recipe. The first line is printed before anything heavy is imported; every start-up failure a user can cause (a
recipe field, the checkpoint's tensors, the tokenizer, the data source, a reward import, the output directory,
the resume point) is one line on stderr naming the field, exit 2, with nothing written. A trainer rank that dies
during the run is one line naming the rank, where it ran and the checkpoint to resume from, exit 1."""

from __future__ import annotations

import argparse
import sys

NAME = "train"
HELP = "Train Beam with a recipe (or check its layout, memory, tokenizer, data and rewards with --dry-run)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", metavar="RECIPE",
                        help="recipe YAML path or shipped name (quickstart, grpo_dapo_math)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="recipe overrides, e.g. trainer.lr=1e-6 run.num_steps=10 (values parsed as YAML)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the recipe, print the GPU layout and per-GPU memory estimate, and run the "
                             "start-up checks (checkpoint tensors, tokenizer, data source, rewards); no GPUs needed")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true",
                       help="continue the run in run.output_dir from its newest complete checkpoint")
    start.add_argument("--overwrite", action="store_true",
                       help="delete an earlier run's outputs in run.output_dir (metrics, samples, summary, "
                            "checkpoints, ...) and start afresh; without it such a directory is refused")
    parser.add_argument("--verbose", action="store_true",
                        help="show third-party warnings (Megatron, torch, SGLang, ...; once per process)")


def say(message: str) -> None:
    print(f"[beamrl] {message}", flush=True)


def run(args: argparse.Namespace) -> int:
    words = " ".join(args.overrides)
    say(f"train {args.recipe}{f' {words}' if words else ''}{' --dry-run' if args.dry_run else ''}: loading "
        "(torch, the recipe)")
    from beamrl.third_party_output import plain_ray_output, quiet

    quiet(args.verbose)
    plain_ray_output()
    from beamrl.recipe import RecipeError, load_recipe
    from beamrl.rewards.loading import importable_working_directory

    importable_working_directory()  # reward modules beside the recipe's user, as for `beamrl reward test`
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        if args.dry_run:
            from beamrl.recipe.dry_run import dry_run

            result = dry_run(recipe)
            print(result.report)
            for problem in result.problems:
                print(f"FAIL: {problem}")
            print("dry-run: OK" if result.ok else f"dry-run: {len(result.problems)} problem(s)")
            return 0 if result.ok else 1
    except (RecipeError, FileNotFoundError) as e:
        print(f"beamrl train: {e}", file=sys.stderr)
        return 2
    say(f"run {recipe.run.name}: {recipe.run.num_steps} steps, outputs in {recipe.run.resolved_output_dir}")
    try:  # imported here: the loop pulls in Ray, Megatron and SGLang, which --dry-run never needs
        from beamrl.loop import TrainerRankLost, run_training
    except ImportError as e:
        if e.name in (None, "beamrl.loop") or "run_training" in str(e):
            raise NotImplementedError(f"beamrl.loop.run_training is not available ({e}); only --dry-run works") \
                from None
        raise
    try:
        result = run_training(recipe, resume=args.resume, overwrite=args.overwrite, verbose=args.verbose)
    except RecipeError as e:  # what only a run checks: files, tokenizer, data, rewards, output directory, resume
        print(f"beamrl train: {e}", file=sys.stderr)
        return 2
    except TrainerRankLost as e:
        print(f"beamrl train: {e}", file=sys.stderr)  # one line: the rank, where it ran, the checkpoint
        return 1
    return result if isinstance(result, int) else 0

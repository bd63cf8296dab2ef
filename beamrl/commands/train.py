"""`beamrl train RECIPE [key=value ...] [--dry-run] [--resume]`: run (or only check) a recipe."""

from __future__ import annotations

import argparse
import sys

NAME = "train"
HELP = "Train Beam with a recipe (or check its layout and memory with --dry-run)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", metavar="RECIPE", help="recipe YAML path or shipped name (quickstart, grpo_dapo_math)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="recipe overrides, e.g. trainer.lr=1e-6 run.num_steps=10 (values parsed as YAML)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the recipe, print the GPU layout and per-GPU memory estimate; no GPUs needed")
    parser.add_argument("--resume", action="store_true", help="resume from the latest checkpoint of the run")


def run(args: argparse.Namespace) -> int:
    from beamrl.recipe import RecipeError, load_recipe

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
    try:  # imported here: the loop pulls in Ray, Megatron and SGLang, which --dry-run never needs
        from beamrl.loop import run_training
    except ImportError as e:
        if e.name in (None, "beamrl.loop") or "run_training" in str(e):
            raise NotImplementedError(f"beamrl.loop.run_training is not available ({e}); only --dry-run works") from None
        raise
    try:
        result = run_training(recipe, resume=args.resume)  # returns the run directory (or an exit code)
    except RecipeError as e:  # a field only a real run can check (e.g. a checkpoint that is not there)
        print(f"beamrl train: {e}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) else 0

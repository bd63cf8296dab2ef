"""Start-up checks of a recipe against this machine: what a run needs that loading the recipe cannot see. They run
before a run writes anything or starts Ray (`beamrl.loop.setup.prepare_run`), and `--dry-run` runs them wherever
the thing to check is here. Each failure is a `RecipeError` naming the field to change (exit 2, one line):

- `model.checkpoint`: every tensor of the Beam weight table present, none foreign, shapes and dtypes right, read
  from the safetensors headers only (no tensor data);
- `data.tokenizer` / `data.chat_template`: the tokenizer loads (offline: a directory, a built-in, or the HF
  cache), fits the model's vocabulary, has the model's eos id, and has a chat template when one is asked for;
- `data.source`: a local file or directory exists (a hub id is looked up when the run loads it);
- `rewards[i].fn`: every reward function imports and accepts its kwargs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from beamrl.models.beam import BeamConfig
from beamrl.recipe.errors import RecipeError

if TYPE_CHECKING:
    from beamrl.recipe.schema import Recipe

# Files an HF tokenizer directory holds (any one of them is enough for AutoTokenizer to try).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class PreflightResult:
    """What the checks loaded (for the run to reuse) and one line per check (for the dry-run report)."""

    tokenizer: Any | None = None  # None: not checkable here (a dry run without the checkpoint mounted)
    reward_functions: list = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def preflight(r: "Recipe", config: BeamConfig) -> PreflightResult:
    """Run every check that can run on this machine against the model config `config`; raise `RecipeError` for
    the first failure. A checkpoint that is not mounted here (a dry run) skips the checks that need it."""
    out = PreflightResult()
    out.lines.append(check_checkpoint_tensors(r))
    out.tokenizer, line = load_run_tokenizer(r)
    if out.tokenizer is not None:
        line = check_tokenizer(r, config, out.tokenizer, line)
    out.lines.append(line)
    out.lines.append(check_data_source(r))
    out.reward_functions = load_reward_functions(r)
    out.lines.append("rewards: " + ", ".join(f"{c.name} = {f.ref}" for c, f in zip(r.rewards, out.reward_functions)))
    return out


def _mounted(r: "Recipe") -> bool:
    return r.model.checkpoint is not None and Path(r.model.checkpoint).is_dir()


def check_checkpoint_tensors(r: "Recipe") -> str:
    """`model.checkpoint`'s tensors against its config.json (safetensors headers only)."""
    from beamrl.models.beam.checkpoint import CheckpointError, check_checkpoint

    ckpt = r.model.checkpoint
    if ckpt is None:
        return "model: random init from the preset (no checkpoint to check)"
    if not _mounted(r):
        return f"model.checkpoint: {ckpt} not mounted here (not checked)"
    try:
        config = check_checkpoint(ckpt)
    except (CheckpointError, FileNotFoundError) as e:
        raise RecipeError("model.checkpoint", ckpt, f"{e} (read from the safetensors headers)") from None
    return f"model.checkpoint: {config.num_parameters():,} parameters, every tensor's name, shape and dtype OK"


def has_tokenizer_files(directory: str | Path) -> bool:
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def load_run_tokenizer(r: "Recipe") -> tuple[Any | None, str]:
    """The run's tokenizer (`data.tokenizer`, else the one saved beside `model.checkpoint`), and a report line."""
    from beamrl.data.prompts import BUILT_IN_TOKENIZERS, load_tokenizer

    name, ckpt = r.data.tokenizer, r.model.checkpoint
    if name is None:
        if ckpt is None:
            raise RecipeError("data.tokenizer", None, "null means the tokenizer saved beside model.checkpoint, but "
                              "this run starts from model.preset (random init): set data.tokenizer to 'digit', "
                              "'byte' or an HF tokenizer directory (docs/data.md, 'Tokenizers')")
        if not _mounted(r):
            return None, f"data.tokenizer: null = the tokenizer of {ckpt}, which is not mounted here (not checked)"
        if not has_tokenizer_files(ckpt):
            raise RecipeError("data.tokenizer", None, f"null means the tokenizer saved beside model.checkpoint, but "
                              f"{ckpt} has none ({' / '.join(TOKENIZER_FILES)}): set data.tokenizer to an HF "
                              "tokenizer directory or 'byte', or write one beside the weights with `beamrl "
                              "init-checkpoint --tokenizer byte|DIR` (docs/data.md, 'Tokenizers')")
    source = name if name is not None else ckpt
    where = name if name in BUILT_IN_TOKENIZERS else f"{source!r}"
    try:
        tokenizer = load_tokenizer(name, ckpt)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; every one is this field's problem
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        offline = ("" if Path(str(source)).exists() else " (offline, a hub id loads only from the HF cache: "
                   "use a local tokenizer directory)")
        raise RecipeError("data.tokenizer", name, f"tokenizer {where} cannot be loaded: {type(e).__name__}: "
                          f"{first}{offline}") from None
    return tokenizer, f"data.tokenizer: {where}"


def _eos_ids(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}


def check_tokenizer(r: "Recipe", config: BeamConfig, tokenizer: Any, line: str) -> str:
    """Vocabulary size, eos id and chat template of the run's tokenizer against the model; returns the report line."""
    value = r.data.tokenizer
    random_init = r.model.checkpoint is None
    size = len(tokenizer)
    if size > config.vocab_size:
        fix = (f"set model.config_overrides.vocab_size: {size} (or more)" if random_init else
               "use the tokenizer this checkpoint was trained with")
        raise RecipeError("data.tokenizer", value, f"has {size} tokens but the model's vocab_size is "
                          f"{config.vocab_size}: the model could not embed every prompt token; {fix}")
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise RecipeError("data.tokenizer", value, "has no eos token: generation could not stop")
    model_eos = _eos_ids(config.eos_token_id)
    if model_eos and int(eos) not in model_eos:
        fix = (f"set model.config_overrides.eos_token_id: {eos}" if random_init else
               "use the tokenizer this checkpoint was trained with")
        raise RecipeError("data.tokenizer", value, f"eos id {eos} differs from the model's eos_token_id "
                          f"{config.eos_token_id}: the engines end a sample at the tokenizer's eos, which is not the "
                          f"model's; {fix}")
    template = bool(getattr(tokenizer, "chat_template", None))
    if r.data.chat_template and not template:
        raise RecipeError("data.chat_template", True, "the tokenizer has no chat template: set data.chat_template: "
                          "false (data.prompt_template then formats the prompt) or use a tokenizer with one (the "
                          "built-in 'byte' tokenizer has one)")
    return (f"{line}: {size} tokens (model vocab_size {config.vocab_size}), eos {eos}"
            f"{', chat template' if template else ''}")


def check_data_source(r: "Recipe") -> str:
    """A local `data.source` exists and holds data files; a hub id is left to the run's loader."""
    from beamrl.data.sources import LOCAL_BUILDERS, looks_like_path

    d = r.data
    if d.source is None:
        return f"data: {d.format} (generated)"
    if not looks_like_path(d.source):
        return f"data.source: hub dataset {d.source!r} (loaded by the run; offline only from the HF cache)"
    path = Path(d.source).expanduser()
    if d.split != type(d).model_fields["split"].get_default():
        raise RecipeError("data.split", d.split, "a local data.source loads all its files as one split (every "
                          ".jsonl/.parquet of a directory); point data.source at that split's files and remove it")
    if not path.exists():
        raise RecipeError("data.source", d.source, f"no such file or directory: {path.resolve()}")
    if path.is_dir() and not any(p.suffix in LOCAL_BUILDERS for p in path.iterdir()):
        raise RecipeError("data.source", d.source, f"directory {path.resolve()} holds no "
                          f"{'/'.join(LOCAL_BUILDERS)} files")
    return f"data.source: {path}"


def load_reward_functions(r: "Recipe") -> list:
    """Every reward function loaded as a run loads it (import, registry, entry points; signature check)."""
    from beamrl.rewards.loading import RewardKwargsError, load_reward_fn

    functions = []
    for i, comp in enumerate(r.rewards):
        try:
            functions.append(load_reward_fn(comp.fn, comp.kwargs.keys()))
        except RewardKwargsError as e:
            raise RecipeError(f"rewards[{i}].kwargs", comp.kwargs, str(e)) from None
        except Exception as e:  # noqa: BLE001 - a user module can raise anything at import
            raise RecipeError(f"rewards[{i}].fn", comp.fn, f"{type(e).__name__}: {e}" if not isinstance(e, ValueError)
                              else str(e)) from None
        default = type(comp).model_fields["max_concurrency"].get_default()
        if not functions[-1].is_async and comp.max_concurrency != default:
            raise RecipeError(f"rewards[{i}].max_concurrency", comp.max_concurrency, f"{comp.fn} is a sync function: "
                              "each worker runs one call at a time; raise num_workers for more calls at once")
    return functions


def load_prompts(r: "Recipe", tokenizer: Any) -> Any:
    """The run's `PromptLoader`, with loading errors named by field (a run loads it before writing anything)."""
    from beamrl.data import build_prompt_loader
    from beamrl.data.formats import RowFormatError

    d = r.data
    try:
        return build_prompt_loader(d, r.rollout.prompts_per_step, tokenizer)
    except FileNotFoundError as e:
        raise RecipeError("data.source", d.source, str(e).removeprefix("data.source: ")) from None
    except RowFormatError as e:
        raise RecipeError("data.format", d.format, str(e)) from None
    except ValueError as e:  # e.g. text the tokenizer cannot encode, or no prompt short enough
        raise RecipeError("data", d.format, str(e)) from None

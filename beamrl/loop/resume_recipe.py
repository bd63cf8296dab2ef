"""A resumed run's recipe against the one its earlier stretch ran with (`recipe.yaml` in the run directory).

Some fields decide what the checkpoints are (the model's shape and dtype, which parameters LoRA trains) or which
prompts come next (the data's format, tokenization, order): a resume that changes them cannot continue the run. They
are refused when the run plans its start, naming the field, before anything starts or is written (before, a changed
`data.shuffle_seed` ended the run with a raw traceback once the trainer and engines were up, and a LoRA run resumed
without LoRA failed loading its checkpoint). Every other change is allowed and listed on the console; the earlier
recipe is kept as `recipe.until_step_<k>.yaml`, so the run directory says what each stretch ran with.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from beamrl.recipe.errors import RecipeError

#: Fields a resume must keep (a prefix covers the fields under it).
FIXED = ("model.preset", "model.config_overrides", "model.dtype", "trainer.lora", "trainer.distributed_optimizer",
         "data.format", "data.split",
         "data.tokenizer", "data.prompt_template", "data.chat_template", "data.shuffle", "data.shuffle_seed",
         "data.max_prompt_len", "data.synthetic")
#: Free-form mappings, compared whole (a key added or removed there is a change, not another beamrl version's field).
WHOLE = ("model.config_overrides", "rollout.server_args")
#: Where the earlier stretch's recipe is kept once a resume changes it.
EARLIER = "recipe.until_step_{step}.yaml"


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict) and d and prefix[:-1] not in WHOLE:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def _fixed(path: str) -> bool:
    return any(path == f or path.startswith(f + ".") for f in FIXED)


def changed_fields(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """(dotted field, earlier value, new value) for every field that differs; a whole section that appears or
    disappears (e.g. `trainer.lora` null vs set) is one entry, with the section's values. A field that only one side
    has, in a section both have (added or removed by another beamrl version), is not a change."""
    a, b = _flat(old), _flat(new)
    out: list[tuple[str, Any, Any]] = []
    for path in sorted(set(a) | set(b)):
        va, vb = a.get(path, _MISSING), b.get(path, _MISSING)
        if va == vb or (va is _MISSING and not _reshaped(path, a)) or (vb is _MISSING and not _reshaped(path, b)):
            continue
        if next((p for p, _, _ in out if path.startswith(p + ".")), None) is None:
            out.append((path, _get(old, path), _get(new, path)))
    return out


def _reshaped(path: str, flat: dict[str, Any]) -> bool:
    """`path` is missing from `flat` because the section there has another shape: a leaf above it (`trainer.lora:
    null` where the other side has `trainer.lora.rank`) or fields below it (the other way round)."""
    parts = path.split(".")
    return (any(".".join(parts[:i]) in flat for i in range(1, len(parts)))
            or any(k.startswith(path + ".") for k in flat))


def _get(d: dict, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


_MISSING = object()


def earlier_recipe(out_dir: Path) -> dict | None:
    """The recipe the run directory's earlier stretch ran with (None when it wrote none: an older run)."""
    import yaml

    path = out_dir / "recipe.yaml"
    if not path.exists():
        return None
    loaded = yaml.safe_load(path.read_text())
    return loaded if isinstance(loaded, dict) else None


def check_resume_recipe(old: dict | None, new: dict, log: Callable[[str], None]) -> list[tuple[str, Any, Any]]:
    """Refuse a change to a `FIXED` field (`RecipeError` naming it); list the other changes on the console. Returns
    every change."""
    if old is None:
        return []
    changes = changed_fields(old, new)
    for path, before, after in changes:
        if _fixed(path):
            raise RecipeError(path, after, f"the run's checkpoints and prompt order come from {before!r}: a resume "
                              "must keep it (set run.output_dir for a new run, or start over with --overwrite)")
    if changes:
        shown = "; ".join(f"{p}: {b!r} -> {a!r}" for p, b, a in changes)
        log(f"resuming with changed settings (this run's apply from here on): {shown}")
    return changes


def check_resume_tokenizer(out_dir: Path, digest: str, field: str, value: Any) -> None:
    """Refuse a resume whose tokenizer tokenizes otherwise than the earlier stretch's (`RecipeError` naming `field`,
    the recipe field the tokenizer came from). The digest is the one the earlier stretch kept in `out_dir`
    (`beamrl.data.tokenizer_identity`); a run from before it was kept is not checked."""
    from beamrl.data.tokenizer_identity import TOKENIZER_DIGEST_FILE

    path = out_dir / TOKENIZER_DIGEST_FILE
    if not path.exists():
        return
    earlier = path.read_text().strip()
    if earlier != digest:
        raise RecipeError(field, value, f"this tokenizer (digest {digest[:12]}) tokenizes otherwise than the one the "
                          f"run's prompts and checkpoints were made with (digest {earlier[:12]}, {path}): a resume "
                          "must keep it (set run.output_dir for a new run, or start over with --overwrite)")


def keep_earlier_recipe(out_dir: Path, step: int) -> Path | None:
    """Before a resume writes its own `recipe.yaml`: keep the earlier one (when it differs) as
    `recipe.until_step_<step>.yaml`, unless one is kept for that step already (the stretch that wrote it ran from
    the same checkpoint and is gone). Returns where it went (None: nothing kept)."""
    path = out_dir / "recipe.yaml"
    kept = out_dir / EARLIER.format(step=step)
    if not path.exists() or kept.exists():  # kept already: a resume from this step before left no steps of its own
        return None
    path.replace(kept)
    return kept

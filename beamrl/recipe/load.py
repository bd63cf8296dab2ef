"""Reading a recipe: YAML file + `a.b.c=value` overrides -> validated `Recipe`.

Overrides are applied to the raw YAML mapping before validation, so they go through exactly the same
checks as the file. Values are YAML-parsed (`trainer.lr=1e-6`, `rollout.server_args={x: 1}`,
`rewards.0.weight=0.5`). An unknown path is an error naming the path and listing the valid keys there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from beamrl.config import ConfigError
from beamrl.recipe.errors import RecipeError, join_path
from beamrl.recipe.schema import MOVED_FIELDS, Recipe, moved_field

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


def shipped_recipes() -> list[str]:
    """Names of the recipes shipped in the repository's `recipes/` folder."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")) if RECIPES_DIR.is_dir() else []


def resolve_recipe_path(name_or_path: str | Path) -> Path:
    """A recipe file path, or the name of a shipped recipe (`quickstart`, `grpo_dapo_math`)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = RECIPES_DIR / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    raise FileNotFoundError(f"recipe not found: {str(name_or_path)!r} is neither a file nor a shipped recipe "
                            f"(shipped: {shipped_recipes()})")


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = (), check_model: bool = True) -> Recipe:
    """Load, override and validate a recipe; raise `RecipeError` naming the first bad field.

    With `check_model` (default) the rules that need the Beam config (heads, experts, layers) run too,
    when the config is available (a preset, or a checkpoint directory that exists here)."""
    file = resolve_recipe_path(path)
    try:
        raw = yaml.safe_load(file.read_text())
    except yaml.YAMLError as e:
        raise RecipeError(str(file), "<yaml>", f"is not valid YAML ({e})") from None
    if not isinstance(raw, dict):
        raise RecipeError(str(file), type(raw).__name__, "a recipe file must hold a YAML mapping of sections")
    for item in overrides:
        apply_override(raw, item)
    recipe = validate_recipe(raw)
    if check_model:
        from beamrl.recipe.layout import check_model_fit
        from beamrl.recipe.model_spec import model_config_if_available

        config = model_config_if_available(recipe)
        if config is not None:
            check_model_fit(recipe, config)
    return recipe


def validate_recipe(raw: dict[str, Any]) -> Recipe:
    """`Recipe.model_validate` with pydantic's errors turned into one `RecipeError` (first error's path)."""
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        raise _to_recipe_error(e) from None


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _to_recipe_error(e: ValidationError) -> RecipeError:
    errors = e.errors()
    first = errors[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):  # a rule of a section (path inside it) or of the recipe (loc is empty)
        return RecipeError(join_path(_dotted(first["loc"]), cause.path), cause.value, cause.allowed)
    path = _dotted(first["loc"])
    if first["type"] == "extra_forbidden" and path in MOVED_FIELDS:
        allowed = moved_field(path)
    elif first["type"] == "extra_forbidden":
        parent = first["loc"][:-1]
        keys = _valid_keys(parent)
        allowed = f"unknown field; valid keys at {_dotted(parent) or 'top level'}: {keys}"
    elif first["type"] == "missing":
        allowed = "required field is missing"
    else:
        allowed = first["msg"].removeprefix("Value error, ")  # a validator's own sentence (e.g. registry choices)
    if len(errors) > 1:
        allowed += f" (and {len(errors) - 1} more: " + "; ".join(
            f"{_dotted(x['loc'])}: {x['msg']}" for x in errors[1:4]) + ")"
    return RecipeError(path or "recipe", first.get("input"), allowed)


def _section_class(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel inside `X`, `X | None` or `list[X]`, else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _section_class(arg)
        if found is not None:
            return found
    return None


def _valid_keys(loc: tuple) -> list[str]:
    cls: type[BaseModel] | None = Recipe
    for part in loc:
        if cls is None:
            return []
        if isinstance(part, int):
            continue
        field = cls.model_fields.get(part)
        cls = _section_class(field.annotation) if field else None
    return sorted(cls.model_fields) if cls is not None else []


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `a.b.c=value` override to a raw recipe mapping in place."""
    if "=" not in item:
        raise RecipeError(item, None, "an override is key.path=value (value parsed as YAML)")
    key, text = item.split("=", 1)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RecipeError(key, text, f"override value is not valid YAML ({e})") from None
    parts = key.strip().split(".")
    node: Any = raw
    cls: type[BaseModel] | None = Recipe
    for depth, part in enumerate(parts):
        here = ".".join(parts[:depth]) or "top level"
        last = depth == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise RecipeError(key, value, f"{here} is a list of {len(node)} entries; use an index 0..{len(node) - 1}")
            idx = int(part)
            if last:
                node[idx] = value
                return
            node = node[idx]
            continue
        free_mapping = cls is None  # inside a dict[str, Any] field (server_args, kwargs): any key is fine
        if not free_mapping and part not in cls.model_fields:
            moved = ".".join(parts[:depth + 1])
            if moved in MOVED_FIELDS:
                raise RecipeError(key, value, moved_field(moved))
            raise RecipeError(key, value, f"unknown field {part!r}; valid keys at {here}: {sorted(cls.model_fields)}")
        if last:
            node[part] = value
            return
        if not free_mapping:
            annotation = cls.model_fields[part].annotation
            cls = _section_class(annotation)
            if cls is None and get_origin(annotation) is not dict and dict not in get_args(annotation):
                raise RecipeError(key, value, f"{'.'.join(parts[:depth + 1])} is a value, not a section")
        if node.get(part) is None:
            node[part] = [] if cls is not None and _is_list(Recipe, parts[: depth + 1]) else {}
        node = node[part]


def _is_list(root: type[BaseModel], parts: list[str]) -> bool:
    cls: type[BaseModel] | None = root
    annotation = None
    for part in parts:
        if cls is None or part.isdigit():
            continue
        annotation = cls.model_fields[part].annotation
        cls = _section_class(annotation)
    return get_origin(annotation) is list

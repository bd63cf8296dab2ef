"""One name per setting: every recipe field reaches the code that uses it under its own name.

Three checks over the whole schema (static, over the source of `beamrl/`):
1. each section is the config class of the component that owns it (defined in that component's package);
2. each field is read by name (`x.<field>`) in the code of its readers, outside the module that defines it;
3. no field is copied into a field of another beamrl config class under a different name
   (`Other(clip_grad=t.grad_clip)`): the renaming that used to happen on the way to the components.
A field that cannot satisfy a check is listed below with the reason.
"""

import ast
import dataclasses
from pathlib import Path

import pytest
from pydantic import BaseModel

from beamrl.recipe.schema import Recipe

BEAMRL = Path(__file__).resolve().parents[2] / "beamrl"

# section -> (module that must define its class, packages whose code reads its fields)
OWNERS = {
    "trainer": ("beamrl.trainer.megatron.config", ["trainer", "loop"]),
    # the recipe package reads the rollout fields that size the placement plan (`layout.placement_of`)
    "rollout": ("beamrl.rollout.config", ["rollout", "loop", "recipe"]),
    "algorithm": ("beamrl.algorithms.config", ["algorithms", "loop"]),
    "data": ("beamrl.data.config", ["data", "loop"]),
    "sync": ("beamrl.sync.config", ["sync", "loop"]),
    "logging": ("beamrl.metrics.config", ["metrics", "loop"]),
    # The RL loop's own sections: read by the loop and by the recipe package's model/dry-run code.
    **{s: ("beamrl.recipe.schema", ["loop", "recipe"])
       for s in ("run", "model", "cluster", "placement", "sft", "checkpoint", "timeouts")},
    # The reward package's own config classes (the recipe holds them as they are).
    "rewards": ("beamrl.rewards.config", ["rewards", "loop"]),
    "reward_pool": ("beamrl.rewards.config", ["rewards", "loop"]),
}

# Fields that no code reads by their name, and why.
NOT_READ_BY_NAME = {
    "run.output_dir": "derived: read through `RunSection.resolved_output_dir` (null = outputs/<run.name>)",
    "sync.bucket_mb": "derived: read through `SyncConfig.bucket_bytes` (MiB -> bytes at the transport)",
    "trainer.lora.alpha": "derived: read through `LoRAConfig.scale` (fp32(alpha / rank), rounded once) by the "
                          "trainer's LoRA modules and the engines' merge; `beamrl/models/beam/peft_io.py` writes it "
                          "as PEFT's lora_alpha",
    "trainer.lora.dropout": "validated only (must be 0.0: the trainer's forward must be the engines'); "
                            "`beamrl/models/beam/peft_io.py` writes it as PEFT's lora_dropout",
}

# (config class, keyword, recipe field) allowed by check 3, and why.
RENAMES_ALLOWED = {
    ("NativeEngineConfig", "model_path", "checkpoint"): "an engine loads model.checkpoint, the seeded random init "
                                                        "or the SFT export (derived); `model_path` is SGLang's name",
    ("SGLangEngineConfig", "model_path", "checkpoint"): "as above",
    ("SGLangEngineConfig", "random_seed", "seed"): "an engine's seed is run.seed + its index (derived); "
                                                   "`random_seed` is SGLang's name",
    # Same word, another setting (not the recipe field of that name):
    ("SGLangEngineConfig", "enable_fp32_lm_head", "dtype"): "`beamrl parity`'s own --dtype decides the FP32 head",
    ("CallOutcome", "elapsed_s", "timeout_s"): "a timed-out reward call reports its limit as its elapsed time",
    ("SyncReport", "verified", "verify"): "whether this sync's probe check ran (the sync session's own flag)",
}
# The limits of `timeouts` are passed to the waits they bound, as a `*timeout*` argument.
TIMEOUTS = set(Recipe.model_fields["timeouts"].annotation.model_fields)
# Config classes that are not a component's config (check 3 does not apply), and why.
NOT_COMPONENT_CONFIGS = {
    "Layout": "the dry-run report (recipe/layout.py) gathers several sections; its names say which section a count "
              "belongs to (trainer_gpus, rollout_gpus, placement)",
}


def _section_class(annotation) -> type[BaseModel] | None:
    """The section class inside `X`, `X | None` or `list[X]`, else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((c for c in map(_section_class, getattr(annotation, "__args__", ())) if c is not None), None)


def _sections(cls: type[BaseModel], prefix: str = ""):
    """(dotted field path, section class holding it, field name) for every field, nested sections included."""
    for name, field in cls.model_fields.items():
        path = f"{prefix}{name}"
        yield path, cls, name
        inner = _section_class(field.annotation)
        if inner is not None:
            yield from _sections(inner, path + ".")


FIELDS = [(p, c, n) for p, c, n in _sections(Recipe) if "." in p]  # leaves and sub-sections below a section


def _modules(parts: list[str]):
    for part in parts:
        for path in sorted((BEAMRL / part).rglob("*.py")):
            yield path, ".".join(path.relative_to(BEAMRL.parent).with_suffix("").parts)


def _read_names(parts: list[str], skip_module: str) -> set[str]:
    """Attribute names read in the packages `parts` (`x.name`, `getattr(x, "name")`), except in `skip_module`."""
    names = set()
    for path, module in _modules(parts):
        if module == skip_module:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                names.add(node.args[1].value)
    return names


def test_every_section_is_its_components_config_class():
    assert set(OWNERS) == set(Recipe.model_fields), "a new section needs an owner in OWNERS"
    for section, (module, _) in OWNERS.items():
        cls = _section_class(Recipe.model_fields[section].annotation)
        assert cls.__module__ == module, f"recipe section {section!r} is {cls.__module__}.{cls.__name__}, " \
                                         f"not its owner's config class (in {module})"


@pytest.mark.parametrize("path,cls,name", FIELDS, ids=[f[0] for f in FIELDS])
def test_field_is_read_by_its_own_name(path, cls, name):
    section = path.split(".")[0]
    _, readers = OWNERS[section]
    if path in NOT_READ_BY_NAME:
        assert name not in _read_names(readers, cls.__module__), f"{path} is read now: drop its exception"
        return
    assert name in _read_names(readers, cls.__module__), (
        f"recipe field {path} is never read as `.{name}` in beamrl/{{{','.join(readers)}}}: it is renamed on "
        f"the way, or unused (list it in NOT_READ_BY_NAME with the reason)")


def _config_classes() -> dict[str, set[str]]:
    """{class name: its field names} for every config class of beamrl: dataclasses and pydantic models (fields
    declared by beamrl classes only, not by a foreign base such as Megatron's TransformerConfig)."""
    import importlib
    import inspect

    classes: dict[str, set[str]] = {}
    for path, module in _modules([p.name for p in BEAMRL.iterdir() if p.is_dir() and not p.name.startswith("_")]):
        if not any(isinstance(n, ast.ClassDef) for n in ast.parse(path.read_text()).body):
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError:  # optional dependencies (GPU-only kernels): not config code
            continue
        for name, obj in inspect.getmembers(mod, inspect.isclass):
            if obj.__module__ != module:
                continue
            if issubclass(obj, BaseModel):
                classes[name] = set(obj.model_fields)
            elif dataclasses.is_dataclass(obj):
                classes[name] = {f for base in obj.__mro__ if base.__module__.startswith("beamrl")
                                 for f in getattr(base, "__annotations__", {})}
    return classes


def _renames(tree: ast.AST, field_names: set[str], classes: dict[str, set[str]]):
    """(class, keyword, field, line) for each `Class(keyword=<...>.field)` that passes a recipe field to a
    differently named field of a beamrl config class (also through a unit shift or a comparison:
    `x.f << 20`, `x.f == "full"`)."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if callee not in classes:
            continue
        for kw in node.keywords:
            value = kw.value
            while isinstance(value, ast.Compare) or (isinstance(value, ast.BinOp)
                                                      and isinstance(value.op, (ast.LShift, ast.RShift))):
                value = value.left
            if (isinstance(value, ast.Attribute) and kw.arg in classes[callee] and value.attr in field_names
                    and kw.arg != value.attr):
                yield callee, kw.arg, value.attr, node.lineno


def test_no_field_is_renamed_on_its_way_to_a_component():
    field_names = {name for _, _, name in FIELDS}
    classes = {k: v for k, v in _config_classes().items() if k not in NOT_COMPONENT_CONFIGS}
    found = []
    for path, module in _modules([p.name for p in BEAMRL.iterdir() if p.is_dir()]):
        for callee, kw, field, line in _renames(ast.parse(path.read_text()), field_names, classes):
            if (callee, kw, field) not in RENAMES_ALLOWED and not (field in TIMEOUTS and "timeout" in kw):
                found.append(f"{path.relative_to(BEAMRL.parent)}:{line}: {callee}({kw}=<...>.{field})")
    assert not found, "recipe fields renamed on the way to a component:\n" + "\n".join(found)


def test_the_rename_check_sees_the_old_renames():
    """The checker itself: the re-packing this test exists to prevent is found, the rest is not."""
    old = ast.parse("OptimizerSettings(clip_grad=t.grad_clip, grad_reduce_in_fp32=t.main_grads_dtype == 'fp32', "
                    "lr=t.lr)\nPolicyLossConfig(eps_low=a.eps_clip_low)\nx.clamp(max=cfg.buffer)\n"
                    "megatron_call(clip_grad=t.grad_clip)\n")
    classes = {"OptimizerSettings": {"clip_grad", "grad_reduce_in_fp32", "lr"}, "PolicyLossConfig": {"eps_low"}}
    got = [(c, kw, f) for c, kw, f, _ in _renames(old, {"grad_clip", "main_grads_dtype", "eps_clip_low", "lr",
                                                         "buffer"}, classes)]
    assert got == [("OptimizerSettings", "clip_grad", "grad_clip"),
                   ("OptimizerSettings", "grad_reduce_in_fp32", "main_grads_dtype"),
                   ("PolicyLossConfig", "eps_low", "eps_clip_low")]

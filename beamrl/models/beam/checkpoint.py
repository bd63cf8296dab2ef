"""Beam checkpoints in SGLang's format: `config.json` + safetensors with the HF names of `weights.py`.

Layout written (HF convention): one `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards plus
`model.safetensors.index.json` (`metadata.total_size`, `weight_map`) when `max_shard_bytes` splits it.
Experts are written per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`) or packed
(`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I]); both
are read back. Every check names the offending field, tensor or file (docs/model.md).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from beamrl.dtypes import torch_dtype
from beamrl.models.beam.config import BeamConfig, BeamConfigError
from beamrl.models.beam.weights import TensorSpec, expected_tensors, packed_expert_names

EXPERT_LAYOUTS = ("per_expert", "packed")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A Beam checkpoint is incomplete, has foreign tensors, or a tensor has the wrong shape or dtype."""


def model_dtype(config: BeamConfig) -> torch.dtype:
    return torch_dtype(config.dtype)


def output_specs(config: BeamConfig, expert_layout: str) -> dict[str, TensorSpec]:
    """Ordered names and specs as written for `expert_layout` (packed tensors replace a layer's experts)."""
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout={expert_layout!r} is invalid; allowed: {list(EXPERT_LAYOUTS)}")
    specs = expected_tensors(config)
    if expert_layout == "per_expert":
        return specs
    E, I, H = config.num_experts, config.moe_intermediate_size, config.hidden_size
    out: dict[str, TensorSpec] = {}
    for name, spec in specs.items():
        if ".mlp.experts." not in name:
            out[name] = spec
        elif name.endswith(f".experts.{E - 1}.down_proj.weight"):
            gate_up, down = packed_expert_names(int(name.split(".")[2]))
            out[gate_up], out[down] = TensorSpec((E, 2 * I, H)), TensorSpec((E, H, I))
    return out


def _pack_experts(config: BeamConfig, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream per-expert tensors into packed ones; a layer's packed pair is emitted after its last expert."""
    E = config.num_experts
    pending: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        if ".mlp.experts." not in name:
            yield name, t
            continue
        pending[name] = t
        if name.endswith(f".experts.{E - 1}.down_proj.weight"):
            layer = int(name.split(".")[2])
            p = f"model.layers.{layer}.mlp.experts."
            try:
                gate = torch.stack([pending.pop(f"{p}{e}.gate_proj.weight") for e in range(E)])
                up = torch.stack([pending.pop(f"{p}{e}.up_proj.weight") for e in range(E)])
                down = torch.stack([pending.pop(f"{p}{e}.down_proj.weight") for e in range(E)])
            except KeyError as e:
                raise CheckpointError(f"cannot pack layer {layer}: expert tensor {e.args[0]!r} missing") from None
            gate_up, down_name = packed_expert_names(layer)
            yield gate_up, torch.cat((gate, up), dim=1).contiguous()
            yield down_name, down.contiguous()
    if pending:
        raise CheckpointError(f"expert tensors left unpacked (incomplete layer?), e.g. {sorted(pending)[:3]}")


def _plan_shards(specs: Mapping[str, TensorSpec], dtype: torch.dtype, max_shard_bytes: int | None) -> list[list[str]]:
    """Greedy split of names (in order) into shards of at most max_shard_bytes (an oversized tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, spec in specs.items():
        nbytes = math.prod(spec.shape) * torch.empty((), dtype=spec.dtype(dtype)).element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def save_checkpoint(config: BeamConfig, state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                    out_dir: str | Path, expert_layout: str = "per_expert", max_shard_bytes: int | None = None,
                    progress=None) -> list[Path]:
    """Write `config.json` and the safetensors files; returns the paths written.

    `state_dict` may be a mapping or a stream of (name, tensor) in `expected_tensors` order (so a huge
    checkpoint is written shard by shard without holding it in memory). Tensors are validated against the
    weight table (names, shapes, config dtype, FP32 router) before being written. `progress(msg)` is called
    once per shard."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = model_dtype(config)
    specs = output_specs(config, expert_layout)
    if isinstance(state_dict, Mapping):
        _check_names(set(state_dict), expected_tensors(config))
        items = ((name, state_dict[name]) for name in expected_tensors(config))  # canonical order for packing
    else:
        items = state_dict
    stream = _pack_experts(config, items) if expert_layout == "packed" else iter(items)
    shards = _plan_shards(specs, dtype, max_shard_bytes)
    n = len(shards)
    files = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    shard_of = {name: i for i, names in enumerate(shards) for name in names}
    config.save(out)
    written = [out / "config.json"]
    buffers: dict[int, dict[str, torch.Tensor]] = {}
    done = 0
    for name, tensor in stream:
        if name not in specs:
            raise CheckpointError(f"unexpected tensor {name!r}: not in the Beam weight table of this config")
        _check_tensor(name, tensor, specs[name], dtype)
        i = shard_of[name]
        buffers.setdefault(i, {})[name] = tensor.detach().to("cpu").contiguous()
        if len(buffers[i]) == len(shards[i]):
            save_file(buffers.pop(i), str(out / files[i]), metadata={"format": "pt"})
            written.append(out / files[i])
            done += 1
            if progress:
                progress(f"wrote {files[i]} ({done}/{n})")
    if buffers or done != n:
        missing = [name for i, names in enumerate(shards) for name in names if i in buffers or
                   not (out / files[i]).exists()]
        raise CheckpointError(f"state dict incomplete: tensor {missing[0]!r} missing ({len(missing)} missing)")
    if n > 1:
        total = sum(math.prod(s.shape) * torch.empty((), dtype=s.dtype(dtype)).element_size() for s in specs.values())
        index = {"metadata": {"total_size": total}, "weight_map": {k: files[shard_of[k]] for k in specs}}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        written.append(out / INDEX_FILE)
    return written


def _check_names(names: set[str], expected: Mapping[str, TensorSpec]) -> None:
    missing = [n for n in expected if n not in names]
    if missing:
        raise CheckpointError(f"tensor {missing[0]!r} missing ({len(missing)} missing in all)")
    extra = sorted(names - set(expected))
    if extra:
        raise CheckpointError(f"unexpected tensor {extra[0]!r}: not in the Beam weight table of this config")


def _check_tensor(name: str, tensor: torch.Tensor, spec: TensorSpec, dtype: torch.dtype) -> None:
    _check_spec(name, tuple(tensor.shape), tensor.dtype, spec, dtype)


def _check_spec(name: str, shape: tuple[int, ...], stored: torch.dtype | str, spec: TensorSpec,
                dtype: torch.dtype) -> None:
    if shape != spec.shape:
        raise CheckpointError(f"tensor {name!r} has shape {shape}, expected {spec.shape}")
    want = spec.dtype(dtype)
    if stored != want:
        why = " (router weights and correction biases are always float32)" if spec.fp32 else " (config dtype)"
        raise CheckpointError(f"tensor {name!r} has dtype {stored}, expected {want}{why}")


def checkpoint_files(directory: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file, from the index when present; names missing files."""
    index = directory / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e!r})") from None
        out = {name: directory / f for name, f in weight_map.items()}
        for f in sorted(set(out.values())):
            if not f.exists():
                raise CheckpointError(f"{index} references missing file {f.name!r}")
        return out
    single = directory / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {directory}")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _directory_and_config(directory: str | Path) -> tuple[Path, BeamConfig]:
    """The checkpoint directory (which must exist) and its parsed `config.json`; errors name the file."""
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory {d} does not exist")
    try:
        return d, BeamConfig.from_json_file(d / "config.json")
    except TypeError as e:  # unexpected keyword etc. surfaces as TypeError from the dataclass
        raise BeamConfigError("config.json", str(d / "config.json"), str(e)) from None


def load_checkpoint(directory: str | Path) -> tuple[BeamConfig, dict[str, torch.Tensor]]:
    """Read and validate a checkpoint; returns (config, per-expert state dict in the stored dtypes)."""
    d, config = _directory_and_config(directory)
    dtype = model_dtype(config)
    per_expert = expected_tensors(config)
    state: dict[str, torch.Tensor] = {}
    for handle, name, spec in _indexed_tensors(d, config):
        t = handle.get_tensor(name)
        _check_tensor(name, t, spec, dtype)
        state[name] = t
    state = _unpack_experts(config, state)
    _check_names(set(state), per_expert)
    return config, state



def _indexed_tensors(d: Path, config: BeamConfig):
    """(open safetensors handle, name, weight-table spec) for every tensor the checkpoint's index lists, one file
    open at a time; a listed tensor missing from its file or one outside the Beam weight table raises."""
    per_expert = expected_tensors(config)
    packed = output_specs(config, "packed")
    by_file: dict[Path, list[str]] = {}
    for name, f in checkpoint_files(d).items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as handle:
            present = set(handle.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"tensor {name!r} listed in the index is missing from {f.name}")
                spec = per_expert.get(name) or packed.get(name)
                if spec is None:
                    raise CheckpointError(f"unexpected tensor {name!r} in {f.name}: not in the Beam weight table")
                yield handle, name, spec

# safetensors header dtype names -> torch dtypes (anything else is reported under its header name)
_HEADER_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def check_checkpoint(directory: str | Path) -> BeamConfig:
    """`load_checkpoint`'s checks (every tensor present, none foreign, shapes and dtypes) from the safetensors
    headers alone: no tensor data is read, so a 1 TB checkpoint is checked in seconds. Returns the config."""
    d, config = _directory_and_config(directory)
    dtype = model_dtype(config)
    per_expert = expected_tensors(config)
    covered: list[str] = []
    for handle, name, spec in _indexed_tensors(d, config):
        header = handle.get_slice(name)
        stored = header.get_dtype()
        _check_spec(name, tuple(header.get_shape()), _HEADER_DTYPES.get(stored, stored), spec, dtype)
        covered += _per_expert_names(config, name)
    if len(covered) != len(set(covered)):
        twice = next(n for n in covered if covered.count(n) > 1)
        raise CheckpointError(f"tensor {twice!r} given both packed and per expert")
    _check_names(set(covered), per_expert)
    return config


def _per_expert_names(config: BeamConfig, name: str) -> list[str]:
    """The per-expert names a stored tensor stands for (a packed tensor covers every expert of its layer)."""
    for packed, parts in (("mlp.experts.gate_up_proj", ("gate_proj", "up_proj")), ("mlp.experts.down_proj",
                                                                                    ("down_proj",))):
        if name.endswith(packed):
            p = name[: -len(packed)] + "mlp.experts."
            return [f"{p}{e}.{part}.weight" for e in range(config.num_experts) for part in parts]
    return [name]


def _unpack_experts(config: BeamConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Convert packed expert tensors into the per-expert names; a tensor given in both layouts is an error."""
    out: dict[str, torch.Tensor] = {}
    I = config.moe_intermediate_size

    def put(name: str, t: torch.Tensor) -> None:
        if name in out:
            raise CheckpointError(f"tensor {name!r} given both packed and per expert")
        out[name] = t

    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            p = name[: -len("gate_up_proj")]
            for e in range(config.num_experts):
                put(f"{p}{e}.gate_proj.weight", t[e, :I].contiguous())
                put(f"{p}{e}.up_proj.weight", t[e, I:].contiguous())
        elif name.endswith("mlp.experts.down_proj"):
            p = name[: -len("down_proj")]
            for e in range(config.num_experts):
                put(f"{p}{e}.down_proj.weight", t[e].contiguous())
        else:
            put(name, t)
    return out

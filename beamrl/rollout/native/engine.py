"""`NativeEngine`: the embedded rollout engine (CPU or one GPU) on top of the reference `BeamForCausalLM`.

It implements `RolloutEngine` and `WeightReceiver` with SGLang's semantics (docs/native-engine.md): logprobs
before truncation, routed experts in SGLang's row layout, weight-update sessions, versions. Calls are
serialised by one lock (as SGLang's scheduler serialises them); each waits for it at most `timeout` seconds.
A failed weight update marks the engine as not serving until a full `update_weights_from_disk` succeeds, so a
half-updated model never serves silently.
"""

from __future__ import annotations

import random
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import torch

from beamrl.models.beam.lora_payload import is_adapter_tensor_name
from beamrl.models.beam.lora_receiver import AdapterReceiver, AdapterRejected
from beamrl.models.beam.model import BeamForCausalLM
from beamrl.rollout.native.config import NativeEngineConfig
from beamrl.rollout.native.generation import generate_batch, routes_array
from beamrl.rollout.protocol import EngineError, GenerateRequest, GenerateResult, RolloutEngine
from beamrl.sync.flat_bucket import FlatBucket, aligned_order
from beamrl.sync.local_receiver import LocalWeightReceiver
from beamrl.sync.protocol import WeightReceiver, WeightSyncError

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class NativeEngine(RolloutEngine, WeightReceiver):
    """Embedded Beam engine. Build from a checkpoint (`NativeEngine(config)`) or around a model
    (`NativeEngine.from_model(model)`, tests and benchmarks)."""

    def __init__(self, config: NativeEngineConfig, model: BeamForCausalLM | None = None):
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        if model is None:
            model = BeamForCausalLM.from_pretrained(config.model_path, dtype=_DTYPES[config.dtype], device=config.device)
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._lock = threading.Lock()
        self._abort_epoch = 0
        self._seeds = random.Random(config.seed)
        self._failure: str | None = None  # why the engine does not serve (failed update)
        self._host_weights: dict[str, torch.Tensor] | None = None  # set while 'weights' are released
        self._closed = False
        self._in_session = False
        self._groups: list[str] = []
        self._receiver = LocalWeightReceiver(self._load_tensors, name=config.name, device=self.model.device,
                                             initial_version=config.weight_version)
        # LoRA (docs/lora.md): adapter payloads merge into the targeted weights from W0 copies kept here.
        self._lora_w0: dict[str, torch.Tensor] = {}
        self._lora = AdapterReceiver(self.model.config, self._lora_base, self.model.load_hf_tensors)
        self._session_loaded_base = False

    @classmethod
    def from_model(cls, model: BeamForCausalLM, name: str = "native-0", max_batch_size: int = 64, seed: int = 0,
                   weight_version: int = 0) -> "NativeEngine":
        dtype = "bfloat16" if model.dtype == torch.bfloat16 else "float32"
        cfg = NativeEngineConfig(model_path="<in-memory>", dtype=dtype, device=str(model.device),
                                 max_batch_size=max_batch_size, seed=seed, name=name, weight_version=weight_version)
        return cls(cfg, model)

    @property
    def name(self) -> str:
        return self.config.name

    # ------------------------------------------------------------------ locking and state
    @contextmanager
    def _locked(self, what: str, timeout: float, error: type[Exception] = EngineError) -> Iterator[None]:
        if self._closed:
            raise error(f"{self.name}: {what} called after shutdown()")
        if not self._lock.acquire(timeout=max(timeout, 0.0)):
            raise error(f"{self.name}: {what} timed out after {timeout:g} s waiting for the engine (busy)")
        try:
            yield
        finally:
            self._lock.release()

    def _require_serving(self, what: str) -> None:
        if self._failure is not None:
            raise EngineError(f"{self.name}: not serving ({self._failure}); reload the full weights with "
                              f"update_weights_from_disk or restart the engine")
        if self._host_weights is not None:
            raise EngineError(f"{self.name}: {what} while the weights are released; call resume_memory(['weights'])")
        if self._in_session:
            raise EngineError(f"{self.name}: {what} during an open weight-update session; end it first")

    # ------------------------------------------------------------------ generation
    def generate(self, requests: list[GenerateRequest], timeout: float) -> list[GenerateResult]:
        deadline = time.monotonic() + timeout
        epoch = self._abort_epoch  # taken before queueing on the lock: abort_all also aborts queued calls
        with self._locked("generate", timeout):
            self._require_serving("generate")
            self._validate(requests)
            results: list[GenerateResult] = []
            bs = self.config.max_batch_size
            for start in range(0, len(requests), bs):
                batch = requests[start:start + bs]
                seeds = [r.sampling.seed if r.sampling.seed is not None else self._seeds.getrandbits(63)
                         for r in batch]
                states = generate_batch(self.model, batch, seeds, lambda: self._abort_epoch != epoch, deadline)
                for r, st in zip(batch, states):
                    results.append(GenerateResult(
                        prompt_ids=list(r.prompt_ids), output_ids=st.output_ids, output_logprobs=st.output_logprobs,
                        finish_reason=st.finish_reason or "abort", weight_version=self.weight_version,
                        routed_experts=routes_array(st, len(r.prompt_ids)) if r.return_routed_experts else None,
                        request_id=r.request_id))
            return results

    def _validate(self, requests: list[GenerateRequest]) -> None:
        V = self.model.config.vocab_size
        for i, r in enumerate(requests):
            if not r.prompt_ids:
                raise EngineError(f"{self.name}: request {r.request_id or i} has an empty prompt")
            bad = [t for t in r.prompt_ids if not 0 <= t < V]
            if bad:
                raise EngineError(f"{self.name}: request {r.request_id or i} has token id {bad[0]} outside the "
                                  f"vocabulary [0, {V})")
            limit = self.model.config.max_position_embeddings
            if len(r.prompt_ids) + r.sampling.max_new_tokens > limit:
                raise EngineError(f"{self.name}: request {r.request_id or i}: prompt ({len(r.prompt_ids)}) + "
                                  f"max_new_tokens ({r.sampling.max_new_tokens}) exceeds max_position_embeddings "
                                  f"({limit})")

    def score(self, sequences: list[list[int]], timeout: float) -> list[list[float]]:
        """Prompt logprobs at T = 1 (right-padded batches of `max_batch_size`)."""
        with self._locked("score", timeout):
            self._require_serving("score")
            self._validate([GenerateRequest(prompt_ids=list(s)) for s in sequences])
            out: list[list[float]] = []
            bs = self.config.max_batch_size
            for start in range(0, len(sequences), bs):
                batch = sequences[start:start + bs]
                T = max(len(s) for s in batch)
                ids = torch.zeros(len(batch), T, dtype=torch.long)
                mask = torch.zeros(len(batch), T, dtype=torch.bool)
                for i, s in enumerate(batch):
                    ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), True
                dev = self.model.device
                lp = self.model.token_logprobs(ids.to(dev), attention_mask=mask.to(dev)).cpu()
                out.extend(lp[i, : len(s) - 1].tolist() for i, s in enumerate(batch))
            return out

    def health(self, timeout: float) -> bool:
        return not self._closed and self._failure is None

    def abort_all(self, timeout: float) -> None:
        """Running requests finish with 'abort' at their next decode step (never waits for the lock)."""
        self._abort_epoch += 1

    def flush_cache(self, timeout: float) -> None:
        """No prefix cache: nothing to flush (KV caches live only inside one `generate` call)."""

    # ------------------------------------------------------------------ memory
    def _check_tags(self, tags: list[str] | None) -> list[str]:
        tags = list(MEMORY_TAGS) if tags is None else list(tags)
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise EngineError(f"{self.name}: unknown memory tag {bad[0]!r}; allowed: {list(MEMORY_TAGS)}")
        return tags

    def release_memory(self, tags: list[str] | None, timeout: float) -> None:
        """'weights': move every parameter into a host copy and free the device storage (on CPU the copy *is* the
        storage, so nothing is freed, but the engine refuses work until resumed). 'kv_cache' / 'cuda_graph':
        nothing persists between calls, so they are accepted no-ops."""
        tags = self._check_tags(tags)
        with self._locked("release_memory", timeout):
            if "weights" in tags and self._host_weights is None:
                host = {}
                for name, p in self.model.named_parameters():
                    host[name] = p.data if p.device.type == "cpu" else p.data.to("cpu")
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                self._host_weights = host
                if self.model.device.type == "cuda":
                    torch.cuda.empty_cache()

    def resume_memory(self, tags: list[str] | None, timeout: float) -> None:
        tags = self._check_tags(tags)
        with self._locked("resume_memory", timeout):
            if "weights" in tags and self._host_weights is not None:
                dev = self.config.device if self.config.device != "cpu" else "cpu"
                for name, p in self.model.named_parameters():
                    p.data = self._host_weights[name].to(dev)
                self._host_weights = None

    # ------------------------------------------------------------------ weights
    @property
    def weight_version(self) -> int:
        return self._receiver.weight_version

    @property
    def tp_size(self) -> int:
        return 1

    def _load_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        base = [(n, t) for n, t in named if not is_adapter_tensor_name(n)]
        if base:
            self._session_loaded_base = True
            updated = self.model.load_hf_tensors(base)
            params = dict(self.model.named_parameters())
            for n in set(updated) & set(self._lora_w0):  # a new W0: keep it, then re-merge the applied adapter
                self._lora_w0[n] = params[n].detach().clone()
            self._lora.reapply(updated)
        adapter = [(n, t) for n, t in named if is_adapter_tensor_name(n)]
        if adapter:
            self._lora.receive(adapter)

    def _lora_base(self, name: str) -> torch.Tensor:
        """W0 of a targeted weight: copied from the parameter before its first merge."""
        if name not in self._lora_w0:
            self._lora_w0[name] = dict(self.model.named_parameters())[name].detach().clone()
        return self._lora_w0[name]

    def apply_lora_adapter(self, payload: list[tuple[str, torch.Tensor]], new_version: int, timeout: float) -> None:
        """Adapter-only update in one session: `payload` from `lora_payload.build_adapter_payload` (manifest +
        full adapter tensors). A refused payload (failed checksum, wrong tensor set) raises `WeightSyncError`,
        leaves the weights and the version unchanged and the engine serving."""
        self.begin_weight_update(timeout)
        try:
            self.update_weights_from_tensor(FlatBucket.from_named_tensors(aligned_order(payload)), timeout)
        except BaseException:
            with self._locked("end_weight_update", timeout, WeightSyncError):
                self._receiver.end_weight_update(self.weight_version, timeout)
                self._in_session = False
            raise
        self.end_weight_update(new_version, timeout)

    @property
    def lora_adapter_id(self) -> str | None:
        """Id of the adapter now merged into the weights (None: base weights only)."""
        return None if self._lora.applied is None else self._lora.applied.adapter_id

    def _require_weights(self, what: str) -> None:
        if self._host_weights is not None:
            raise WeightSyncError(f"{self.name}: {what} while the weights are released; call "
                                  f"resume_memory(['weights']) first")

    def _session_update(self, what: str, timeout: float, call) -> None:
        """Run a bucket update inside the open session. Any failure may leave earlier buckets applied, so it
        stops the engine from serving (a call outside a session is refused first and changes nothing)."""
        with self._locked(what, timeout, WeightSyncError):
            if not self._in_session:
                raise WeightSyncError(f"{self.name}: {what} must run between begin_weight_update() and "
                                      f"end_weight_update()")
            self._require_weights(what)
            try:
                call()
            except Exception as exc:
                # A refused adapter was checked before anything was written: the engine keeps serving, unless this
                # session had already loaded base weights.
                rejected = isinstance(exc, AdapterRejected) or isinstance(exc.__cause__, AdapterRejected)
                if not rejected or self._session_loaded_base:
                    self._failure = f"{what} failed: {exc}"
                raise exc if isinstance(exc, WeightSyncError) else WeightSyncError(f"{self.name}: {exc}") from exc

    def begin_weight_update(self, timeout: float) -> None:
        with self._locked("begin_weight_update", timeout, WeightSyncError):
            self._receiver.begin_weight_update(timeout)
            self._in_session = True
            self._session_loaded_base = False

    def update_weights_from_tensor(self, bucket: FlatBucket, timeout: float) -> None:
        self._session_update("update_weights_from_tensor", timeout,
                             lambda: self._receiver.update_weights_from_tensor(bucket, timeout))

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, timeout: float) -> None:
        """Receive one uint8 broadcast laid out by (names, dtypes, shapes); the group's own timeout (set at
        `init_weights_update_group`) bounds the wait for the sender."""
        self._session_update("update_weights_from_distributed", timeout,
                             lambda: self._receiver.update_weights_from_distributed(names, dtypes, shapes,
                                                                                    group_name, timeout))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str, timeout: float) -> None:
        """Join a new process group (TCP rendezvous at master_address:master_port) as `rank_offset`; the trainer
        (rank 0) must join concurrently. Collectives of the group time out after `timeout` s."""
        with self._locked("init_weights_update_group", timeout, WeightSyncError):
            self._receiver.init_weights_update_group(master_address, master_port, rank_offset, world_size,
                                                     group_name, backend, timeout)
            self._groups.append(group_name)

    def destroy_weights_update_group(self, group_name: str, timeout: float) -> None:
        with self._locked("destroy_weights_update_group", timeout, WeightSyncError):
            self._receiver.destroy_weights_update_group(group_name, timeout)
            self._groups.remove(group_name)

    def update_weights_from_disk(self, path: str, timeout: float) -> None:
        """Load a full checkpoint (no session needed, as in SGLang). Every tensor is validated before any is
        copied, so a failure leaves the weights unchanged; success also clears an earlier update failure."""
        with self._locked("update_weights_from_disk", timeout, WeightSyncError):
            self._require_weights("update_weights_from_disk")
            self._receiver.update_weights_from_disk(path, timeout)
            self._failure = None

    def end_weight_update(self, new_version: int, timeout: float) -> None:
        """Close the session and serve `new_version`. After a failed update in the session, the session is closed
        without bumping the version and `WeightSyncError` is raised (the engine stays not serving)."""
        if int(new_version) < 0:
            raise WeightSyncError(f"{self.name}: weight version must be >= 0, got {new_version}")
        with self._locked("end_weight_update", timeout, WeightSyncError):
            failed = self._failure
            self._receiver.end_weight_update(self.weight_version if failed else int(new_version), timeout)
            self._in_session = False
            if failed:
                raise WeightSyncError(f"{self.name}: session closed without serving version {new_version}: {failed}")

    def update_weight_version(self, new_version: int, timeout: float) -> None:
        with self._locked("update_weight_version", timeout, WeightSyncError):
            self._receiver.set_weight_version(int(new_version), timeout)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._abort_epoch += 1  # a running generate stops at its next step
        locked = self._lock.acquire(timeout=60.0)
        try:
            for group in list(self._groups) if locked else []:
                try:
                    self._receiver.destroy_weights_update_group(group, 10.0)
                except WeightSyncError:
                    pass  # tearing down anyway
            self._closed = True
        finally:
            if locked:
                self._lock.release()

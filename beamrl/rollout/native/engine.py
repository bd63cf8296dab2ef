"""`NativeEngine`: the embedded rollout engine (CPU or one GPU) on top of the reference `BeamForCausalLM`.

It implements `RolloutEngine` and `WeightReceiver` with SGLang's semantics (docs/native-engine.md): logprobs
before truncation, routed experts in SGLang's row layout, weight-update sessions, versions. Calls are
serialised by one lock (as SGLang's scheduler serialises them); each waits for it at most `timeout` seconds.
Weight updates go through `LocalWeightReceiver` (manifest, per-bucket checksums, staged buckets): a failed session
is rolled back (on CPU by default) or marks the engine as not serving until a full `update_weights_from_disk`
succeeds (GPU), so a half-updated model never serves silently.
"""

from __future__ import annotations

import random
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import torch

from beamrl.dtypes import dtype_name, torch_dtype
from beamrl.models.beam.lora_config import LoRAConfig
from beamrl.models.beam.lora_payload import ADAPTER
from beamrl.models.beam.model import BeamForCausalLM
from beamrl.rollout.native.config import NativeEngineConfig
from beamrl.rollout.native.generation import generate_batch, routes_array
from beamrl.protocols.rollout import EngineError, GenerateRequest, GenerateResult, RolloutEngine
from beamrl.protocols.flat_bucket import FlatBucket
from beamrl.protocols.manifest import FULL, SyncManifest
from beamrl.rollout.native.lora_target import AdapterTarget, LoRABaseWeights
from beamrl.sync.local_receiver import LocalWeightReceiver
from beamrl.protocols.weights import WeightReceiver, WeightSyncError

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class NativeEngine(RolloutEngine, WeightReceiver):
    """Embedded Beam engine. Build from a checkpoint (`NativeEngine(config)`) or around a model
    (`NativeEngine.from_model(model)`, tests and benchmarks)."""

    def __init__(self, config: NativeEngineConfig, model: BeamForCausalLM | None = None):
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        if model is None:
            model = BeamForCausalLM.from_pretrained(config.model_path, dtype=torch_dtype(config.dtype),
                                                    device=config.device)
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._lock = threading.Lock()
        self._abort_epoch = 0
        self._seeds = random.Random(config.seed)
        # while 'weights' are released: each parameter's shape, dtype and device
        self._released: dict[str, tuple[tuple[int, ...], torch.dtype, torch.device]] | None = None
        self._host_weights: dict[str, torch.Tensor] = {}  # the backup (weights_cpu_backup): pinned, reused on CUDA
        self._closed = False
        targets = {}
        self._adapter: AdapterTarget | None = None
        if config.lora is not None:  # adapter-only syncs (docs/lora.md): merged into the weights at commit
            self._adapter = AdapterTarget(self.model, config.lora)
            targets = {ADAPTER: self._adapter, FULL: LoRABaseWeights(self.model, self._adapter)}
        self._receiver = LocalWeightReceiver(self.model, name=config.name, initial_version=config.weight_version,
                                             rollback=config.rollback, targets=targets)

    @classmethod
    def from_model(cls, model: BeamForCausalLM, name: str = "native-0", max_batch_size: int = 64, seed: int = 0,
                   weight_version: int = 0, rollback: bool | None = None,
                   lora: LoRAConfig | None = None) -> "NativeEngine":
        cfg = NativeEngineConfig(model_path="<in-memory>", dtype=dtype_name(model.dtype), device=str(model.device),
                                 max_batch_size=max_batch_size, seed=seed, name=name, weight_version=weight_version,
                                 rollback=rollback, lora=lora)
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
        if self._receiver.failure is not None:
            raise EngineError(f"{self.name}: not serving ({self._receiver.failure}); reload the full weights with "
                              f"update_weights_from_disk or restart the engine")
        if self._released is not None:
            raise EngineError(f"{self.name}: {what} while the weights are released; call resume_memory(['weights'])")
        if self._receiver.unloaded is not None:
            raise EngineError(f"{self.name}: {what} before the weights were loaded: {self._receiver.unloaded}")
        if self._receiver.in_session:
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
        return not self._closed and self._receiver.failure is None

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
        """'weights': free the parameters' device storage, after copying them to host memory if
        `weights_cpu_backup` (on CPU the host copy *is* the storage: nothing is freed, but the engine refuses work
        until resumed). 'kv_cache' / 'cuda_graph': nothing persists between calls, so they are accepted no-ops."""
        tags = self._check_tags(tags)
        with self._locked("release_memory", timeout):
            if "weights" in tags and self._released is None:
                if self._receiver.in_session:
                    raise EngineError(f"{self.name}: release_memory(['weights']) during an open weight-update "
                                      f"session would lose its applied buckets; end or abort it first")
                self._release_weights()

    def _release_weights(self) -> None:
        cuda = self.model.device.type == "cuda"
        params = list(self.model.named_parameters())
        if self.config.weights_cpu_backup:
            for name, p in params:
                if not cuda:
                    self._host_weights[name] = p.data
                    continue
                host = self._host_weights.get(name)
                if host is None or host.shape != p.shape or host.dtype != p.dtype:
                    host = self._host_weights[name] = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
                host.copy_(p.data, non_blocking=True)
            if cuda:
                torch.cuda.synchronize(self.model.device)  # every copy is done before its storage is freed
        # Each parameter comes back where it was (not where the config says: a model given in memory may differ).
        self._released = {name: (tuple(p.shape), p.dtype, p.device) for name, p in params}
        for _, p in params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if cuda:
            torch.cuda.empty_cache()

    def resume_memory(self, tags: list[str] | None, timeout: float) -> None:
        """'weights': new device storage, filled from the host copy (`weights_cpu_backup`) or left for the next full
        weight update to fill (the engine refuses to serve until one has)."""
        tags = self._check_tags(tags)
        with self._locked("resume_memory", timeout):
            if "weights" in tags and self._released is not None:
                backup = self.config.weights_cpu_backup
                devices = set()
                for name, p in self.model.named_parameters():
                    shape, dtype, dev = self._released[name]
                    devices.add(dev)
                    if not backup:
                        p.data = torch.empty(shape, dtype=dtype, device=dev)
                    elif dev.type == "cpu":
                        p.data = self._host_weights.pop(name)
                    else:
                        p.data = self._host_weights[name].to(dev, non_blocking=True)
                for dev in devices:
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                if not backup:
                    self._receiver.unloaded = ("they were released without a host copy (weights_cpu_backup off), "
                                               "so a full weight update (or update_weights_from_disk) must load every "
                                               "weight after resume_memory(['weights'])")
                self._released = None

    # ------------------------------------------------------------------ weights
    @property
    def weight_version(self) -> int:
        return self._receiver.weight_version

    @property
    def tp_size(self) -> int:
        return 1

    @property
    def adapters_applied(self) -> int:
        """LoRA: how many adapter syncs were committed (0: base weights only, or no LoRA config)."""
        return 0 if self._adapter is None else self._adapter.adapter_version

    def _require_weights(self, what: str) -> None:
        if self._released is not None:
            raise WeightSyncError(f"{self.name}: {what} while the weights are released; call "
                                  f"resume_memory(['weights']) first")

    def _weights_call(self, what: str, timeout: float, call, needs_weights: bool = True):
        """Run one weight-update call of the receiver under the engine lock (`LocalWeightReceiver` holds the
        session, its checks and the failure policy: docs/weight-sync.md)."""
        with self._locked(what, timeout, WeightSyncError):
            if needs_weights:
                self._require_weights(what)
            return call()

    def begin_weight_update(self, manifest: SyncManifest, timeout: float) -> None:
        self._weights_call("begin_weight_update", timeout,
                           lambda: self._receiver.begin_weight_update(manifest, timeout))

    def update_weights_from_tensor(self, bucket: FlatBucket, timeout: float) -> None:
        self._weights_call("update_weights_from_tensor", timeout,
                           lambda: self._receiver.update_weights_from_tensor(bucket, timeout))

    def update_weights_from_distributed(self, index: int, checksum: tuple[int, int], group_name: str,
                                        timeout: float) -> None:
        """Receive bucket `index` as one uint8 broadcast; the group's own timeout (set at
        `init_weights_update_group`) bounds the wait for the sender."""
        self._weights_call("update_weights_from_distributed", timeout,
                           lambda: self._receiver.update_weights_from_distributed(index, checksum, group_name,
                                                                                  timeout))

    def staging_supported(self, timeout: float) -> bool:
        return True

    def attach_staging(self, slots: list, timeout: float) -> list:
        return self._weights_call("attach_staging", timeout, lambda: self._receiver.attach_staging(slots, timeout),
                                  needs_weights=False)

    def detach_staging(self, timeout: float) -> None:
        self._weights_call("detach_staging", timeout, lambda: self._receiver.detach_staging(timeout),
                           needs_weights=False)

    def load_staged_bucket(self, slot: int, index: int, timeout: float) -> None:
        self._weights_call("load_staged_bucket", timeout,
                           lambda: self._receiver.load_staged_bucket(slot, index, timeout))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str, timeout: float) -> None:
        """Join a new process group (TCP rendezvous at master_address:master_port) as `rank_offset`; the trainer
        (rank 0) must join concurrently. Collectives of the group time out after `timeout` s."""
        self._weights_call("init_weights_update_group", timeout, lambda: self._receiver.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend, timeout), needs_weights=False)

    def destroy_weights_update_group(self, group_name: str, timeout: float) -> None:
        self._weights_call("destroy_weights_update_group", timeout,
                           lambda: self._receiver.destroy_weights_update_group(group_name, timeout),
                           needs_weights=False)

    def update_weights_from_disk(self, path: str, timeout: float) -> None:
        """Load a full checkpoint (no session needed, as in SGLang). Every tensor is validated before any is
        copied, so a failure leaves the weights unchanged; success also clears an earlier update failure."""
        self._weights_call("update_weights_from_disk", timeout,
                           lambda: self._receiver.update_weights_from_disk(path, timeout))

    def end_weight_update(self, new_version: int, timeout: float) -> None:
        """Commit the session and serve `new_version`; a failed commit is rolled back or leaves the engine not
        serving (the receiver's policy) and raises."""
        if int(new_version) < 0:
            raise WeightSyncError(f"{self.name}: weight version must be >= 0, got {new_version}")
        self._weights_call("end_weight_update", timeout,
                           lambda: self._receiver.end_weight_update(new_version, timeout), needs_weights=False)

    def abort_weight_update(self, reason: str, timeout: float) -> str:
        return self._weights_call("abort_weight_update", timeout,
                                  lambda: self._receiver.abort_weight_update(reason, timeout), needs_weights=False)

    def update_weight_version(self, new_version: int, timeout: float) -> None:
        self._weights_call("update_weight_version", timeout,
                           lambda: self._receiver.update_weight_version(int(new_version), timeout),
                           needs_weights=False)

    def served_weight_version(self, timeout: float) -> int:
        return self._receiver.weight_version

    def weights_checksum(self, timeout: float) -> str:
        """SHA-256 over every parameter's name and raw bytes: equal before and after a refused or rolled-back
        sync, different after a real one (SGLang's engine answers the same question with `check_weights`)."""
        import hashlib

        with self._locked("weights_checksum", timeout):
            h = hashlib.sha256()
            for name, p in self.model.named_parameters():
                h.update(name.encode())
                h.update(p.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
            return h.hexdigest()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._abort_epoch += 1  # a running generate stops at its next step
        locked = self._lock.acquire(timeout=60.0)
        try:
            for group in self._receiver.group_names if locked else []:
                try:
                    self._receiver.destroy_weights_update_group(group, 10.0)
                except WeightSyncError:
                    pass  # tearing down anyway
            self._closed = True
        finally:
            if locked:
                self._lock.release()

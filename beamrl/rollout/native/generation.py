"""Batched generation on `BeamForCausalLM` with its KV cache: one left-padded prefill of each distinct prompt, then
one decode forward per step for every unfinished request at once (finished rows are dropped from the cache).

Requests with the same prompt (GRPO's n samples of a prompt) share its prefill, as SGLang's radix cache shares a
cached prefix: the prompt is run once and its cache row copied to every request that has it. The copies are the
same bits, so the samples of one prompt start from one prefill. Against prefilling every copy, the prompts' logits
and keys can differ in the last bits (a GEMM's rounding depends on its row count on CPU), as they already did with
the batch's other prompts and its padding. While the rows are copied, the distinct prompts' cache and the requests'
one both exist: at most (distinct + requests) rows, for a moment (n/8 + n for GRPO's 8 samples per prompt)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from beamrl.models.beam.kv_cache import KVCache
from beamrl.models.beam.model import BeamForCausalLM
from beamrl.rollout.native.sampler import RowSampling, sample
from beamrl.protocols.rollout import EngineError, GenerateRequest


@dataclass
class RowState:
    """Output of one request while it is generated."""

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    routes: list[np.ndarray] = field(default_factory=list)  # int32 [n, L, k] chunks (views), in token order
    finish_reason: str | None = None


def _stop_ids(req: GenerateRequest, eos: int | list[int] | None) -> set[int]:
    stops = set(req.sampling.stop_token_ids)
    if not req.sampling.ignore_eos and eos is not None:
        stops |= set(eos) if isinstance(eos, list) else {eos}
    return stops


def row_sampling(requests: list[GenerateRequest], seeds: list[int], vocab: int) -> RowSampling:
    """Tensors of the per-request controls; temperature 0 becomes greedy (top_k 1 at T 1), as in SGLang."""
    temps, top_k, top_p = [], [], []
    for r in requests:
        s = r.sampling
        greedy = s.temperature == 0
        temps.append(1.0 if greedy else s.temperature)
        top_k.append(1 if greedy else (vocab if s.top_k == -1 else min(s.top_k, vocab)))
        top_p.append(s.top_p)
    return RowSampling(torch.tensor(temps, dtype=torch.float32), torch.tensor(top_k, dtype=torch.long),
                       torch.tensor(top_p, dtype=torch.float32), torch.tensor(seeds, dtype=torch.long))


def distinct_prompts(requests: list[GenerateRequest]) -> tuple[list[tuple[int, ...]], list[int]]:
    """The distinct prompts of `requests` in order of first use, and each request's index into them."""
    index: dict[tuple[int, ...], int] = {}
    prompt_of = [index.setdefault(tuple(r.prompt_ids), len(index)) for r in requests]
    return list(index), prompt_of


@torch.inference_mode()  # not just no_grad: no version counters or view tracking on the ~5k ops of a batch
def generate_batch(model: BeamForCausalLM, requests: list[GenerateRequest], seeds: list[int],
                   should_abort: Callable[[], bool], deadline: float) -> list[RowState]:
    """Generate every request of one batch. `should_abort()` is polled between steps (rows finish 'abort');
    past `deadline` (time.monotonic) an `EngineError` is raised."""
    c = model.config
    dev = model.device
    n = len(requests)
    prompts, prompt_of = distinct_prompts(requests)
    lengths = [len(p) for p in prompts]
    T = max(lengths)
    max_new = max(r.sampling.max_new_tokens for r in requests)
    # Left padding, built as lists and turned into tensors once (not four tensor ops per row).
    ids = torch.tensor([[0] * (T - k) + list(p) for p, k in zip(prompts, lengths)], dtype=torch.long)
    mask = torch.tensor([[False] * (T - k) + [True] * k for k in lengths], dtype=torch.bool)
    want_routes = any(r.return_routed_experts for r in requests)
    params = row_sampling(requests, seeds, c.vocab_size)
    stops = [_stop_ids(r, c.eos_token_id) for r in requests]
    states = [RowState() for _ in requests]

    cache = KVCache(c, len(prompts), T + max_new, model.dtype, dev)
    out = model(ids.to(dev), attention_mask=mask.to(dev), kv_cache=cache, return_routes=want_routes,
                last_logits_only=True)
    if want_routes:  # one host copy per forward; rows are numpy views of it (no per-row tensor ops)
        prefill = out.routes.cpu().numpy()
        for i, r in enumerate(requests):
            if r.return_routed_experts:
                u = prompt_of[i]
                states[i].routes.append(prefill[u, T - lengths[u]:])  # left padding: the last lengths[u] slots
    logits = out.logits[:, -1]
    if len(prompts) < n:  # every request gets its prompt's cache row and last logits
        shared = torch.tensor(prompt_of, dtype=torch.long, device=dev)
        cache.select_rows(shared)
        logits = logits.index_select(0, shared)
    active = list(range(n))  # request index of each cache row
    step = 0
    while active:
        if time.monotonic() > deadline:
            raise EngineError(f"native engine: generation did not finish before the deadline "
                              f"({len(active)} of {n} requests still running after {step} steps)")
        if should_abort():
            for i in active:
                states[i].finish_reason = "abort"
            break
        rows = torch.tensor(active, dtype=torch.long)
        tokens, logprobs = sample(logits.cpu(), params.select(rows), torch.full((len(active),), step))
        keep: list[int] = []
        for j, (i, tok, lp) in enumerate(zip(active, tokens.tolist(), logprobs.tolist())):
            st = states[i]
            st.output_ids.append(tok)
            st.output_logprobs.append(lp)
            if tok in stops[i]:
                st.finish_reason = "stop"
            elif len(st.output_ids) >= requests[i].sampling.max_new_tokens:
                st.finish_reason = "length"
            else:
                keep.append(j)
        if not keep:
            break
        if len(keep) < len(active):
            cache.select_rows(keep)
        active = [active[j] for j in keep]
        nxt = tokens[torch.tensor(keep)].view(-1, 1).to(dev)
        out = model(nxt, kv_cache=cache, return_routes=want_routes)
        if want_routes:
            decoded = out.routes.cpu().numpy()
            for j, i in enumerate(active):
                if requests[i].return_routed_experts:
                    states[i].routes.append(decoded[j])
        logits = out.logits[:, -1]
        step += 1
    return states


def routes_array(state: RowState, prompt_len: int) -> np.ndarray:
    """int32 [prompt_len + output_len - 1, L, k]: row t is token t's forward; the last sampled token is never
    forwarded (an aborted request did forward it; that row is dropped to keep SGLang's shape)."""
    rows = max(prompt_len + len(state.output_ids) - 1, prompt_len if not state.output_ids else 0)
    return np.concatenate(state.routes)[:rows].astype(np.int32, copy=False)

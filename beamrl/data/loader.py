"""`PromptLoader`: seeded per-epoch shuffling, batches of prompts, and an exact resume position.

The order of epoch e is a permutation drawn from a generator seeded by (shuffle_seed, e), so it depends on
nothing but the seed, the epoch and the number of prompts: a run resumed from `state_dict()` sees exactly
the prompts an uninterrupted run would have seen.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from beamrl.data.config import DataConfig, SyntheticAdditionConfig
from beamrl.data.formats import FORMATS
from beamrl.data.prompts import encode_prompt, format_prompt
from beamrl.data.sample import PromptSample
from beamrl.data.sources import load_rows, synthetic_addition_rows

log = logging.getLogger(__name__)


class PromptLoader:
    """Hands out batches of `batch_size` prompts forever, epoch after epoch (a batch may span two epochs)."""

    def __init__(self, samples: list[PromptSample], batch_size: int, shuffle: bool = True, seed: int = 0):
        if not samples:
            raise ValueError("PromptLoader: no prompts (empty source, or every prompt longer than data.max_prompt_len)")
        if batch_size < 1:
            raise ValueError(f"PromptLoader: batch_size={batch_size} must be >= 1")
        self.samples, self.batch_size, self.shuffle, self.seed = samples, batch_size, shuffle, seed
        self.epoch, self.index = 0, 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self.samples)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.samples)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next_batch(self, size: int | None = None) -> list[PromptSample]:
        """The next `size` (default batch_size) prompts; advances the position."""
        out = []
        for _ in range(self.batch_size if size is None else size):
            if self.index == len(self.samples):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            out.append(self.samples[int(self._order[self.index])])
            self.index += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """The position (epoch, index) plus what must match on resume (seed, shuffle, number of prompts)."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "shuffle": self.shuffle,
                "num_prompts": len(self.samples)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position; refuse if the data or seed differ (the prompts would not be the same)."""
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle), ("num_prompts", len(self.samples))):
            if state.get(key) != mine:
                raise ValueError(f"PromptLoader.load_state_dict: saved {key}={state.get(key)!r} but this loader has "
                                 f"{mine!r}; resuming would change the prompt order")
        if not 0 <= state["index"] <= len(self.samples) or state["epoch"] < 0:
            raise ValueError(f"PromptLoader.load_state_dict: bad position epoch={state['epoch']} index={state['index']}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._epoch_order(self.epoch)


def build_samples(rows: Any, fmt: str, tokenizer: Any, template: str | None, chat_template: bool,
                  max_prompt_len: int) -> tuple[list[PromptSample], int]:
    """Parse, format and tokenize every row; drop (and count) prompts longer than max_prompt_len tokens."""
    parse = FORMATS.get(fmt)
    samples, dropped = [], 0
    for i, row in enumerate(rows):
        parsed = parse(dict(row), i)
        text = format_prompt(parsed.messages, tokenizer, template, chat_template)
        ids = encode_prompt(text, tokenizer, chat_template)
        if len(ids) > max_prompt_len:
            dropped += 1
            continue
        samples.append(PromptSample(text, ids, parsed.ground_truth, parsed.data_source, parsed.metadata, i))
    return samples, dropped


def build_prompt_loader(data: DataConfig, batch_size: int, tokenizer: Any,
                        cache_dir: str | None = None) -> PromptLoader:
    """The loader the `data` section describes, handing out `batch_size` prompts at a time (the RL loop's
    rollout.prompts_per_step). `tokenizer`: the run's (`load_tokenizer(data.tokenizer, model.checkpoint)`)."""
    if data.format == "synthetic-addition":
        syn = data.synthetic or SyntheticAdditionConfig()
        rows: Any = synthetic_addition_rows(syn.num_samples, syn.max_operand, syn.seed)
    else:
        rows = load_rows(data.source, data.split, cache_dir=cache_dir)
    samples, dropped = build_samples(rows, data.format, tokenizer, data.prompt_template, data.chat_template,
                                     data.max_prompt_len)
    if dropped:
        log.warning("data: dropped %d of %d prompts longer than data.max_prompt_len=%d tokens",
                    dropped, dropped + len(samples), data.max_prompt_len)
    return PromptLoader(samples, batch_size, data.shuffle, data.shuffle_seed)

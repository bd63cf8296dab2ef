"""Sampled completions with their rewards (`logging.samples`): a few lines on the console and one JSON object per
completion in `<output_dir>/samples.jsonl`, so a user whose reward stays at 0 can see whether the policy gets the
format or the answer wrong."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

FILENAME = "samples.jsonl"
CONSOLE_CHARS = 160  # a completion is cut to this on the console (samples.jsonl keeps it whole)


@dataclass(frozen=True)
class CompletionSample:
    """One sampled completion as the reward functions saw it. `step` is metrics.jsonl's (0-based)."""

    step: int
    prompt: Any  # the prompt text (or the dataset's chat messages)
    completion: str
    ground_truth: Any
    reward: float  # raw total reward (before shaping)
    advantage: float
    response_len: int
    finish_reason: str


def samples_due(step: int, every_n_steps: int, num_steps: int) -> bool:
    """Samples are shown at the first step, every `every_n_steps` steps and the last step (0: never)."""
    if every_n_steps <= 0:
        return False
    return step == 0 or (step + 1) % every_n_steps == 0 or step + 1 == num_steps


def _clip(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)  # quoted, with newlines shown as \n
    return text if len(text) <= CONSOLE_CHARS else text[: CONSOLE_CHARS - 4] + '..."'


def format_samples(samples: list[CompletionSample], num_steps: int | None = None) -> list[str]:
    """Console lines: a header, then `reward | prompt -> completion | answer` per sample."""
    if not samples:
        return []
    step = samples[0].step + 1  # the console counts steps from 1
    lines = [f"samples of step {step}{f'/{num_steps}' if num_steps else ''} (reward | prompt -> completion | "
             "ground truth):"]
    for s in samples:
        lines.append(f"  {s.reward:7.3f} | {_clip(s.prompt)} -> {_clip(s.completion)} | {_clip(s.ground_truth)}"
                     f"{' [cut at max_new_tokens]' if s.finish_reason == 'length' else ''}")
    return lines


class SampleLog:
    """Appends to <output_dir>/samples.jsonl (a resumed run continues it) and prints to the console."""

    def __init__(self, output_dir: str | Path, console: bool, num_steps: int | None = None,
                 stream: TextIO | None = None):
        self.path = Path(output_dir) / FILENAME
        self.console, self.num_steps, self.stream = console, num_steps, stream
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, samples: list[CompletionSample]) -> None:
        for s in samples:
            self._file.write(json.dumps(asdict(s), ensure_ascii=False) + "\n")
        self._file.flush()
        if self.console:
            for line in format_samples(samples, self.num_steps):
                print(line, file=self.stream or sys.stdout, flush=True)

    def close(self) -> None:
        self._file.close()

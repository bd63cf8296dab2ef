"""`PromptSample`: one prompt as the RL loop sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PromptSample:
    """prompt: the formatted text given to the tokenizer; prompt_ids: its token ids; ground_truth: what the
    reward compares against; data_source: routes reward functions; metadata: every other column of the
    row; index: the row's position in the source (stable across shuffles and resumes)."""

    prompt: str
    prompt_ids: list[int]
    ground_truth: str
    data_source: str
    metadata: dict[str, Any] = field(default_factory=dict)
    index: int = -1

"""Exact-match reward, used by the quickstart's single-digit addition task."""

from __future__ import annotations

from typing import Any

from beamrl.rewards.registry import reward


@reward("exact_match")
def exact_match(completion: str, ground_truth: Any) -> float:
    """1.0 if the stripped completion equals str(ground_truth) stripped, else 0.0.

    >>> exact_match(" 7\\n", 7)
    1.0
    """
    return 1.0 if completion.strip() == str(ground_truth).strip() else 0.0

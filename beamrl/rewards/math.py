"""DAPO math reward, verified with math-verify 0.9.0.

The answer is the content of the LAST `\\boxed{...}` in the completion, or failing that the last
`Answer: ...` line (DAPO's prompt asks for "Answer: $Answer" on the last line). Gold and answer are
both parsed as `\\boxed{...}` and compared with `verify(gold, answer)` (gold first: verify is asymmetric).

Scores: `correct_score` (1.0) when equivalent, else `incorrect_score`. We default incorrect to 0.0, not
DAPO's -1.0, so that `reward/<name>/mean` reads as accuracy; set `kwargs: {incorrect_score: -1.0}` in the
component config to reproduce DAPO exactly (GRPO advantages are invariant to this affine change).

math-verify's own timeouts use SIGALRM, which only works in a main thread; they are switched off here
(`parsing_timeout=None`, `timeout_seconds=None`) and the reward pool enforces the component's timeout.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from beamrl.rewards.registry import reward
from beamrl.rewards.types import RewardOutput

_ANSWER_LINE = re.compile(r"^\s*\**\s*Answer\s*\**\s*:\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if absent or unclosed.

    >>> last_boxed(r"so \\boxed{1} or rather \\boxed{\\frac{1}{2}}.")
    '\\\\frac{1}{2}'
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    while start != -1:
        i = text.find("{", start)
        if i != -1 and text[start:i].strip() in ("\\boxed", "\\fbox"):
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j].strip()
        # unclosed or "\boxed 5" style: look further left
        start = max(text.rfind("\\boxed", 0, start), text.rfind("\\fbox", 0, start))
    return None


def extract_answer(completion: str) -> str | None:
    """The last boxed answer, else the last `Answer: ...` line (trailing $ and . stripped), else None."""
    boxed = last_boxed(completion)
    if boxed:
        return boxed
    lines = _ANSWER_LINE.findall(completion)
    if lines:
        ans = lines[-1].strip().rstrip(".").strip().strip("$").strip()
        return ans or None
    return None


class _DropTimeoutDisabledNotice(logging.Filter):
    """math-verify logs that its timeouts are off; here that is intended (the pool enforces ours)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_quiet = False


def _verify(gold: str, answer: str) -> bool:
    global _quiet
    from math_verify import parse, verify

    if not _quiet:
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_DropTimeoutDisabledNotice())
        _quiet = True
    g = parse(f"\\boxed{{{gold}}}", parsing_timeout=None)
    a = parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
    if not g or not a:
        return False
    return bool(verify(g, a, timeout_seconds=None))


@reward("dapo_math")
def dapo_math(
    completion: str, ground_truth: Any, correct_score: float = 1.0, incorrect_score: float = 0.0
) -> RewardOutput:
    """`correct_score` if the completion's final answer equals `ground_truth` mathematically, else
    `incorrect_score`. Metrics: acc (1/0), has_answer (1/0: a boxed or "Answer:" answer was found)."""
    gold = str(ground_truth).strip()
    gold_boxed = last_boxed(gold)  # gold given as "\boxed{...}" is accepted too
    gold = gold_boxed if gold_boxed else gold
    answer = extract_answer(completion or "")
    correct = answer is not None and bool(gold) and _verify(gold, answer)
    return RewardOutput(
        score=correct_score if correct else incorrect_score,
        metrics={"acc": 1.0 if correct else 0.0, "has_answer": 0.0 if answer is None else 1.0},
    )


def _warmup() -> None:
    _verify("1", "1")  # math-verify's first call imports sympy/antlr: about a second, paid at worker start


dapo_math.warmup = _warmup  # type: ignore[attr-defined]  # called by reward workers before they report ready

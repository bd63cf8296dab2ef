"""Reward plugins for end-to-end runs that need a learning signal from step 0 (imported by path in the workers)."""


def first_digit(completion: str) -> float:
    """The completion's first character as a digit / 9 (0 when it is not a digit): samples of one prompt score
    differently even from a random policy, so every step has non-zero advantages and changes the weights."""
    c = completion.strip()[:1]
    return int(c) / 9 if c.isdigit() else 0.0

"""The usage examples in the reward modules' docstrings must run as written."""

import doctest
import importlib

import pytest


@pytest.mark.parametrize(
    "name", ["beamrl.rewards.math", "beamrl.rewards.exact", "beamrl.rewards.loading", "beamrl.rewards.breaker"]
)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0 and result.attempted > 0

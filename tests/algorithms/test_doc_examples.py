"""The usage examples in the algorithms' docstrings must run as written."""

import doctest
import importlib

import pytest

MODULES = [
    "beamrl.registry",
    *(f"beamrl.algorithms.{m}" for m in ("advantages", "kl", "importance", "policy_loss", "dapo")),
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0

"""The comparison math of `beamrl parity`: logprob gaps, top-k SET agreement, JSON shape."""

import json

import numpy as np
import pytest

from beamrl.parity.comparison import Comparison, format_table, logprob_diffs, routing_matches, summarize, write_json


def test_logprob_diffs_are_absolute_and_flattened():
    d = logprob_diffs([[-1.0, -2.0], [-3.0]], [[-1.5, -1.0], [-3.25]])
    np.testing.assert_allclose(d, [0.5, 1.0, 0.25])
    with pytest.raises(ValueError, match="sequence 0"):
        logprob_diffs([[-1.0]], [[-1.0, -2.0]])
    with pytest.raises(ValueError, match="non-finite"):
        logprob_diffs([[float("nan")]], [[-1.0]])


def test_routing_matches_compares_sets_on_moe_layers_only():
    a = np.array([[[-1, -1], [1, 2], [3, 4]],
                  [[-1, -1], [5, 6], [7, 0]]])
    b = np.array([[[9, 9], [2, 1], [3, 4]],      # dense layer differs (ignored); same set in another order
                  [[-1, -1], [5, 6], [7, 1]]])   # one expert differs on layer 2
    m = routing_matches(a, b, moe_layers=[1, 2])
    np.testing.assert_array_equal(m, [[True, True], [True, False]])
    assert summarize("reference", "sglang", "float32", np.array([0.0, 1.0]), [m]).routing_agreement == 0.75


def test_summarize_and_json_shape(tmp_path):
    row = summarize("reference", "sglang", "bfloat16", np.array([1e-3, 3e-3]))
    assert row == Comparison("reference", "sglang", "bfloat16", 2, pytest.approx(2e-3), 3e-3, None)
    path = tmp_path / "p.json"
    write_json([row], path)
    data = json.loads(path.read_text())
    assert list(data) == ["comparisons"]
    assert set(data["comparisons"][0]) == {"a", "b", "dtype", "tokens", "mean_abs_logprob_diff",
                                           "max_abs_logprob_diff", "routing_agreement"}
    assert "n/a" in format_table([row])
    with pytest.raises(ValueError, match="no tokens"):
        summarize("a", "b", "float32", np.zeros(0))

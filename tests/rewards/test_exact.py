from beamrl.rewards.exact import exact_match


def test_exact_match():
    assert exact_match(" 7\n", "7") == 1.0
    assert exact_match("7", 7) == 1.0
    assert exact_match("17", "7") == 0.0

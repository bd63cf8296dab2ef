"""Teardown says which actor's shutdown did not complete (it was dropped silently; an SGLang server's process
group can outlive its actor). Ray is replaced by stand-ins here; real teardowns run in every e2e test."""

from types import SimpleNamespace

from beamrl.loop import groups
from beamrl.loop.ray_utils import ActorCallError


def test_a_failed_shutdown_is_said_and_the_actor_still_killed(monkeypatch, capsys):
    def no_answer(ref, timeout, what):
        raise ActorCallError(f"{what}: no answer within 30 s\nmore lines from Ray")

    killed = []
    monkeypatch.setattr(groups, "ray_get", no_answer)
    monkeypatch.setattr(groups.ray, "kill", killed.append)
    actor = SimpleNamespace(shutdown=SimpleNamespace(remote=lambda: "ref"))
    groups.shutdown_actors([actor], ["sglang-0"])
    out = capsys.readouterr()
    said = out.out + out.err
    assert "sglang-0: its shutdown did not complete (sglang-0.shutdown: no answer within 30 s)" in said
    assert "more lines" not in said and killed == [actor]


def test_peers_stuck_alike_are_asked_together_under_one_deadline(monkeypatch):
    """Trainer ranks left in a collective by a failed one: one deadline for all (it was 30 s per rank)."""
    import time

    waits = []

    def stuck(ref, timeout, what):
        waits.append(timeout)
        time.sleep(min(timeout, 0.2))
        raise ActorCallError(f"{what}: no answer within {timeout:.0f} s")

    monkeypatch.setattr(groups, "ray_get", stuck)
    monkeypatch.setattr(groups.ray, "kill", lambda a: None)
    ranks = [SimpleNamespace(shutdown=SimpleNamespace(remote=lambda: "ref")) for _ in range(4)]
    groups.shutdown_actors(ranks, [f"trainer-{r}" for r in range(4)], together=True, timeout_s=0.5)
    assert all(w <= 0.5 for w in waits) and sum(waits) < 1.5  # the time left, not 0.5 s each again

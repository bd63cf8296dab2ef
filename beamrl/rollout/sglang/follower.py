"""`SGLangFollower`: a node of a multi-node SGLang engine other than the leader (node rank >= 1).

Its server process runs the schedulers of the engine's TP ranks on this node and answers `/health` only; every
API call (generation, weight updates) goes to the leader, which reaches these ranks through SGLang's own
process group. The follower is watched for liveness (`health`) so that a dead node names itself instead of
leaving the leader to time out. It is shut down after the leader: the leader's shutdown stops every TP rank, and
a follower still running after that is terminated (then killed).
"""

from __future__ import annotations

from beamrl.rollout.sglang.config import SGLangEngineConfig
from beamrl.rollout.sglang.server import SGLangServer


class SGLangFollower:
    """One follower node's server (see the module docstring)."""

    def __init__(self, server: SGLangServer) -> None:
        self.server = server

    @classmethod
    def launch(cls, config: SGLangEngineConfig, start_timeout: float = 600.0, log_path=None) -> "SGLangFollower":
        """Start the follower's server and wait until its `/health` answers (its schedulers joined the leader's)."""
        if config.node_rank == 0:
            raise ValueError("node rank 0 is the engine's leader: launch it as an SGLangHTTPEngine")
        return cls(SGLangServer(config, log_path=log_path).start(start_timeout))

    @property
    def name(self) -> str:
        c = self.server.config
        return f"sglang-follower@{self.server.url} (node rank {c.node_rank}/{c.nnodes})"

    @property
    def pid(self) -> int | None:
        return self.server.pid

    def health(self, timeout: float) -> bool:
        return self.server.health(timeout)

    def shutdown(self) -> None:
        self.server.stop()

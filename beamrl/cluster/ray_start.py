"""Starting or joining Ray for a run.

- GPU: join the cluster that `launch/` started (`connect_cluster_ray`); Ray's token authentication stays as the
  cluster has it (on by default in Ray 2.60).
- CPU, one node: a private single-node Ray (`init_local_ray`).
- CPU, `cluster.num_nodes > 1`: a local multi-node Ray cluster (`start_rehearsal_cluster`), one simulated node per
  recipe node, so a layout can be rehearsed on one machine before paying for GPUs.

On CPU every node declares `cluster.gpus_per_node` units of `WORKER_SLOT` (the CPU stand-in for a GPU that the
placement groups reserve) and a node-identity resource (`node_resource(i)`): all simulated nodes share the address
127.0.0.1, so the identity resource is what orders them.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

WORKER_SLOT = "worker_slot"
NODE_RESOURCE_PREFIX = "beamrl_node_"


def node_resource(i: int) -> str:
    """The identity resource of simulated node `i` (one unit; orders nodes that share an address)."""
    return f"{NODE_RESOURCE_PREFIX}{i}"


def _quiet_local_env() -> None:
    # Local clusters stay on loopback and off the network (ray-and-friends.md §1.5-1.6). Token authentication is
    # off for them: every process is on this machine and binds 127.0.0.1 only.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def new_temp_dir() -> Path:
    """A fresh folder for a local Ray cluster's files, `/tmp/beamrl-ray-*`: short, because Ray's AF_UNIX socket
    paths under it (`session_<date>_<pid>/sockets/plasma_store.1`) must fit 107 bytes. The caller removes it."""
    return Path(tempfile.mkdtemp(prefix="beamrl-ray-", dir="/tmp"))


def init_local_ray(num_cpus: int, temp_dir: Path, object_store_mb: int = 512,
                   resources: dict[str, float] | None = None, runtime_env: dict | None = None) -> None:
    """Start a fresh single-node Ray for a CPU run (`address="local"`: never join a cluster another process left
    running on this machine): quiet, loopback only, bounded object store. `runtime_env`: the job's (e.g.
    `beamrl.third_party_output.worker_runtime_env`). A no-op when this process is already connected."""
    if ray.is_initialized():
        return
    _quiet_local_env()
    temp_dir.mkdir(parents=True, exist_ok=True)
    # On a heavily loaded machine the raylet can miss Ray's start-up deadline; that is worth a second try,
    # and the error after the last try is Ray's own.
    for attempt in range(3):
        try:
            ray.init(address="local", num_cpus=num_cpus, resources=resources, include_dashboard=False,
                     logging_level="ERROR", log_to_driver=True, object_store_memory=object_store_mb << 20,
                     _temp_dir=str(temp_dir.resolve()), configure_logging=True, runtime_env=runtime_env)
            return
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
            if "timed out during startup" not in str(e) or attempt == 2:
                raise
            print(f"[beamrl] Ray start-up timed out (machine overloaded?); retrying ({attempt + 2}/3)", flush=True)
            ray.shutdown()


@dataclass
class RehearsalCluster:
    """A local Ray cluster of several simulated nodes (Ray's `cluster_utils.Cluster`), joined by this process."""

    cluster: Any
    num_nodes: int
    slots_per_node: int
    address_file: Path | None = None  # Ray's default address file, as it was before this cluster (see below)
    previous_address: str | None = None

    def shutdown(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()  # deletes Ray's default address file
        self.restore_address_file()

    def restore_address_file(self) -> None:
        """Put Ray's default address file back as it was: `Cluster` writes this cluster's address there (and deletes
        the file at shutdown), where a `ray.init()` elsewhere on the machine, or a real `ray start` cluster's users,
        would find it. beamrl joins this cluster by its own address and does not need the file."""
        if self.address_file is None:
            return
        try:
            if self.previous_address is None:
                self.address_file.unlink(missing_ok=True)
            else:
                self.address_file.write_text(self.previous_address)
        except OSError:
            pass


def start_rehearsal_cluster(num_nodes: int, slots_per_node: int, temp_dir: Path, object_store_mb: int = 128,
                            runtime_env: dict | None = None) -> RehearsalCluster:
    """Start `num_nodes` simulated nodes on this machine, each with `slots_per_node` worker slots and its identity
    resource, and connect this process to them (node 0 is the head, where this process runs; the address is the
    new cluster's own, so no other cluster on the machine is joined). `runtime_env`: the job's."""
    from ray._common.utils import get_ray_address_file  # private, as is the write it prepares for (ray pinned)
    from ray.cluster_utils import Cluster

    _quiet_local_env()
    temp_dir.mkdir(parents=True, exist_ok=True)
    # `Cluster` records the head's address in the *default* Ray folder (/tmp/ray, or under $RAY_TMPDIR), not in
    # `temp_dir`, and does not create that folder: on a machine where Ray never ran, starting the head failed with
    # FileNotFoundError. The file is put back as it was once the cluster runs (`restore_address_file`).
    address_file = Path(get_ray_address_file(None))
    address_file.parent.mkdir(parents=True, exist_ok=True)
    previous = address_file.read_text() if address_file.exists() else None

    def args(i: int) -> dict:
        return dict(num_cpus=1, resources={WORKER_SLOT: slots_per_node, node_resource(i): 1},
                    object_store_memory=object_store_mb << 20)

    cluster = Cluster(initialize_head=True, head_node_args=dict(args(0), include_dashboard=False,
                                                                temp_dir=str(temp_dir.resolve())))
    out = RehearsalCluster(cluster, num_nodes, slots_per_node, address_file, previous)
    try:
        for i in range(1, num_nodes):
            cluster.add_node(**args(i))
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=True, configure_logging=True,
                 runtime_env=runtime_env)
        out.restore_address_file()
    except BaseException:
        out.shutdown()
        raise
    return out


def connect_cluster_ray(runtime_env: dict | None = None) -> None:
    """Join the Ray cluster started by `launch/` (`RAY_ADDRESS` or `ray start` on this node). `runtime_env`: the
    job's."""
    if not ray.is_initialized():
        ray.init(address="auto", logging_level="ERROR", runtime_env=runtime_env)

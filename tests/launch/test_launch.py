"""Launchers: syntax, shellcheck (when installed), ray_cluster.sh --dry-run structure, and beamrl.sbatch run
against fake Slurm/Ray tools that record their arguments."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = [REPO / "launch" / "ray_cluster.sh", REPO / "launch" / "slurm" / "beamrl.sbatch", REPO / "launch" / "env.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script):
    subprocess.run(["shellcheck", "-x", "-s", "bash", str(script)], check=True, cwd=script.parent)


def _dry_run(tmp_path, *args):
    hosts = tmp_path / "hosts"
    hosts.write_text("gpu-node-01   # head\n\n# spare: gpu-node-09\ngpu-node-02\n")
    out = subprocess.run(["bash", str(SCRIPTS[0]), "--dry-run", "--port", "6400", "--repo", "/opt/beamrl",
                          *args[:-1], str(hosts), *args[-1]], check=True, capture_output=True, text=True)
    return out.stdout.splitlines()


def test_ray_cluster_dry_run_structure(tmp_path):
    lines = _dry_run(tmp_path, ["beamrl", "train", "recipes/grpo_dapo_math.yaml", "run.num_steps=5"])
    assert len(lines) == 6
    # Ray token authentication: a token installed on every host first (through stdin), then required everywhere
    assert [l.split()[1] for l in lines[:2]] == ["gpu-node-01", "gpu-node-02"]
    assert all("cat > ~/.ray/beamrl_auth_token' < (this cluster's token)" in l for l in lines[:2])
    lines = lines[2:]
    assert all(l.startswith("ssh ") and "cd /opt/beamrl && source launch/env.sh" in l for l in lines)
    assert all("export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$HOME/.ray/beamrl_auth_token" in l for l in lines)
    head, worker, wait, train = lines
    assert head.startswith("ssh gpu-node-01 ") and "ray start --head --port=6400" in head  # head first
    assert worker.startswith("ssh gpu-node-02 ") and "ray start --address=gpu-node-01:6400" in worker
    assert wait.startswith("ssh gpu-node-01 ") and "wait_for_ray.py --address gpu-node-01:6400 --nodes 2" in wait
    assert train.startswith("ssh gpu-node-01 ") and train.endswith(
        "beamrl train recipes/grpo_dapo_math.yaml run.num_steps=5'")


def test_ray_cluster_stop_and_errors(tmp_path):
    lines = _dry_run(tmp_path, "--stop", [])
    assert [l.split()[1] for l in lines] == ["gpu-node-01", "gpu-node-02"] and all("ray stop" in l for l in lines)
    r = subprocess.run(["bash", str(SCRIPTS[0]), "--dry-run", str(tmp_path / "missing")], capture_output=True, text=True)
    assert r.returncode == 2 and "host file not found" in r.stderr


FAKE = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$FAKE_LOG"
if [[ "$(basename "$0")" =~ ^(ray|beamrl)$ ]]; then
  echo "auth $RAY_AUTH_MODE $(wc -c < "$RAY_AUTH_TOKEN_PATH") $(stat -c %a "$RAY_AUTH_TOKEN_PATH")" >> "$FAKE_LOG"
fi
if [[ "$(basename "$0")" == srun && " $* " == *" hostname "* ]]; then echo 10.0.0.1; fi
if [[ "$(basename "$0")" == scontrol ]]; then printf 'n1\\nn2\\nn3\\n'; fi
exit 0
"""


def test_sbatch_with_fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("srun", "scontrol", "ray", "python", "beamrl"):
        (bin_dir / tool).write_text(FAKE)
        (bin_dir / tool).chmod(0o755)
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO / "launch", checkout / "launch")
    log = tmp_path / "log"
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_LOG": str(log), "RECIPE": "recipes/q.yaml",
           "SLURM_SUBMIT_DIR": str(checkout), "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_GPUS_PER_NODE": "h200:8"}
    r = subprocess.run(["bash", str(checkout / "launch" / "slurm" / "beamrl.sbatch"), "run.num_steps=2"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    # background `ray start` steps may log in any order relative to each other; check what must hold
    head = next(i for i, c in enumerate(calls) if "ray start --head" in c)
    waits = [i for i, c in enumerate(calls) if c.startswith("python launch/wait_for_ray.py")]
    workers = [c for c in calls if "ray start --address=10.0.0.1:6379" in c]
    train = calls.index("beamrl train recipes/q.yaml run.num_steps=2")
    assert "--num-gpus=8" in calls[head] and "-w n1" in calls[head]
    assert sorted(c.split("-w ")[1].split()[0] for c in workers) == ["n2", "n3"]
    assert "--nodes 3" in calls[waits[-1]] and waits[-1] < train
    assert any("ray stop" in c for c in calls[train:])  # cleanup on exit
    assert "NCCL_CUMEM_ENABLE" not in r.stderr
    # Ray token authentication: every `ray` call and the driver see a private 64-hex-digit token; removed at exit
    auth = [c for c in calls if c.startswith("auth ")]
    assert len(auth) == sum(c.startswith(("ray ", "beamrl ")) for c in calls) and set(auth) == {"auth token 64 600"}
    assert not list((checkout / ".ray-auth").iterdir())


def test_sbatch_dry_run_skips_ray(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("srun", "scontrol", "ray", "python", "beamrl"):
        (bin_dir / tool).write_text(FAKE)
        (bin_dir / tool).chmod(0o755)
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO / "launch", checkout / "launch")
    log = tmp_path / "log"
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_LOG": str(log), "RECIPE": "r.yaml",
           "SLURM_SUBMIT_DIR": str(checkout), "SLURM_JOB_NODELIST": "n1"}
    subprocess.run(["bash", str(checkout / "launch" / "slurm" / "beamrl.sbatch"), "--dry-run"], env=env, check=True,
                   timeout=60)
    assert log.read_text().splitlines()[0] == "beamrl train r.yaml --dry-run"
    assert not (checkout / ".ray-auth").exists()  # a layout check starts no Ray and makes no token

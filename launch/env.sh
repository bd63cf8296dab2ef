# Environment for every beamrl process on a GPU cluster; sourced by ray_cluster.sh and slurm/beamrl.sbatch
# before `ray start`, so Ray actors (trainer, engines) inherit it. Each line says why.
# SGLang runs with NCCL's cuMem allocator off; the trainer's NCCL groups must match it or the weight-update
# group between them fails (ray-and-friends.md §1.9).
export NCCL_CUMEM_ENABLE=0
# NVLink multicast (NVLS) off: its buffers take GPU memory per communicator and it has hung broadcasts on
# shared machines; the measured broadcast bandwidth (~370 GB/s on 2 H200) is without it.
export NCCL_NVLS_ENABLE=0
# No usage-stats network calls from Ray; unbuffered Python so progress lines reach the Slurm log at once.
export RAY_USAGE_STATS_ENABLED=0
export PYTHONUNBUFFERED=1

"""The rank's data files: written in parallel, digests computed while writing equal the files' SHA-256, each tensor
stored with only its own bytes (views re-wrapped without a copy), torch DCP reads them back, failures name the
file."""

import hashlib
import json

import pytest
import torch

from beamrl.trainer.megatron.checkpoint import file_writer
from beamrl.trainer.megatron.launch import launch


def _state():
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(3 * 4096, generator=g)  # an optimizer-like flat buffer; its slices are stored as tensors
    return {
        "bf16": torch.randn(256, 64, generator=g).to(torch.bfloat16),
        "view_a": flat[:4096].view(64, 64),
        "view_b": flat[4096:2 * 4096],
        "strided": torch.randn(64, 128, generator=g)[:, ::2],  # not contiguous: copied
        "small": torch.arange(7, dtype=torch.int64),
    }


def _save_and_load(directory: str, threads: int):
    """One gloo rank: plan, write with `threads` writer threads, finalize, load back into fresh tensors."""
    from pathlib import Path

    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from beamrl.trainer.megatron.checkpoint import storage

    dist.init_process_group("gloo")
    file_writer.WRITE_THREADS = threads
    state = _state()
    sharded = {k: ShardedTensor.from_rank_offsets(k, v, replica_id=0) for k, v in state.items()}
    pending = storage.plan(sharded, Path(directory), validate=True)
    storage.write_files(pending)
    stats = json.loads(pending.results_file.read_text())["stats"]
    files, _ = storage.finalize(pending, True)
    crc_after = torch.serialization.get_crc32_options()
    targets = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v, memory_format=torch.contiguous_format),
                                                  replica_id=0) for k, v in state.items()}
    loaded = storage.load(targets, Path(directory))
    dist.barrier()
    return {"files": files, "stats": stats, "crc_after": crc_after,
            "equal": {k: torch.equal(loaded[k], state[k]) for k in state}}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fw")
    return directory, launch(_save_and_load, 1, (str(directory), 3), timeout_s=300)[0]


def test_files_are_written_in_parallel_and_read_back(written):
    directory, out = written
    assert sorted(out["files"]) == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    assert out["stats"]["files"] == 3 and out["stats"]["bytes"] == sum(e["size"] for e in out["files"].values())
    assert out["equal"] == {k: True for k in _state()}
    assert out["crc_after"] is True  # the process-wide zip CRC setting is restored


def test_digests_computed_while_writing_are_the_files_sha256(written):
    directory, out = written
    for name, entry in out["files"].items():
        data = (directory / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


def test_views_are_stored_with_their_own_bytes_only(written):
    directory, out = written
    state = _state()
    payload = sum(t.nbytes for t in state.values())
    total = sum(e["size"] for e in out["files"].values())
    # A view saved as is would carry the whole flat buffer (3 x 16 KiB) twice.
    assert total < payload + 2 * 4096 * 4
    view = state["view_b"]
    own = file_writer._own_storage(view)
    assert own.data_ptr() == view.data_ptr() and own.untyped_storage().nbytes() == view.nbytes  # no copy


def test_buckets_balance_bytes():
    class Item:
        def __init__(self, i):
            self.index = i

    staged = {i: torch.empty(n, dtype=torch.uint8) for i, n in enumerate([100, 90, 60, 50, 40, 10])}
    buckets = file_writer._balanced([Item(i) for i in staged], staged, 3)
    loads = sorted(sum(staged[it.index].nbytes for it in b) for b in buckets)
    assert loads == [110, 110, 130]


def _write_into_a_directory_named_like_a_file(directory: str):
    from pathlib import Path

    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from beamrl.trainer.megatron.checkpoint import storage

    dist.init_process_group("gloo")
    (Path(directory) / "__0_1.distcp").mkdir(parents=True)
    file_writer.WRITE_THREADS = 2
    sharded = {k: ShardedTensor.from_rank_offsets(k, v, replica_id=0) for k, v in _state().items()}
    pending = storage.plan(sharded, Path(directory), validate=True)
    try:
        storage.write_files(pending)
    except file_writer.FileWriteError as e:
        return str(e)
    return None


def test_a_failed_write_names_the_file(tmp_path):
    error = launch(_write_into_a_directory_named_like_a_file, 1, (str(tmp_path / "ck"),), timeout_s=300)[0]
    assert error is not None and "__0_1.distcp" in error and "IsADirectoryError" in error

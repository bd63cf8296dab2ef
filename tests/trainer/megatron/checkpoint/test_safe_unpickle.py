"""DCP metadata is read through an allowlist; non-tensor items are refused unread (no process group needed)."""

import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from beamrl.trainer.megatron.checkpoint.safe_unpickle import SafeFileSystemReader, UnsafeCheckpointError, load_metadata


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # what a hostile checkpoint would do on unpickling
        return (os.mkdir, (self.marker,))


def test_real_dcp_metadata_loads_like_torchs_reader(tmp_path):
    dcp.save({"w": torch.arange(6.0).view(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}, checkpoint_id=tmp_path,
             no_dist=True)
    ours = load_metadata(tmp_path)
    theirs = dcp.FileSystemReader(tmp_path).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data


def test_hostile_metadata_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker))))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refusing to load posix\.mkdir"):
        load_metadata(tmp_path)
    with pytest.raises(UnsafeCheckpointError):
        SafeFileSystemReader(tmp_path).read_metadata()
    assert not marker.exists()


def test_pickled_items_are_refused_unread(tmp_path):
    from beamrl.trainer.megatron.checkpoint.storage import _TensorOnlyLoadPlanner

    dcp.save({"obj": io.BytesIO(pickle.dumps(_RunsCode(str(tmp_path / "pwned"))))}, checkpoint_id=tmp_path,
             no_dist=True)
    # torch's loader wraps the planner's error in its CheckpointException (with the message)
    with pytest.raises(dcp.api.CheckpointException, match="'obj' is a pickled object"):
        dcp.load({"obj": io.BytesIO()}, storage_reader=SafeFileSystemReader(tmp_path),
                 planner=_TensorOnlyLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False), no_dist=True)
    assert not (tmp_path / "pwned").exists()

"""A fixture for modules that run the tiny model in-process (import it into a conftest.py)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """The tiny model's ops are far too small for intra-op threads; on a busy 2-core CI box, OpenMP barriers with
    2 threads make them 5-10x slower. Restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

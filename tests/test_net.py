"""reserve_port: the port stays ours until released, yet the server it is reserved for can bind it."""

import datetime
import socket

import pytest
import torch.distributed as dist

from beamrl.net import reserve_port


def test_a_reserved_port_is_not_handed_out_but_a_store_can_bind_it():
    with reserve_port("127.0.0.1") as reserved:
        assert 1024 <= reserved.port <= 65535
        with socket.socket() as other, pytest.raises(OSError):  # a plain bind (another process) is refused
            other.bind(("127.0.0.1", reserved.port))
        for _ in range(200):  # the OS never picks it for anyone asking for a free port
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                assert probe.getsockname()[1] != reserved.port
        timeout = datetime.timedelta(seconds=30)
        store = dist.TCPStore("127.0.0.1", reserved.port, 1, is_master=True, timeout=timeout)  # the real server
        client = dist.TCPStore("127.0.0.1", reserved.port, 1, is_master=False, timeout=timeout)
        store.set("key", "value")
        assert client.get("key") == b"value"
        del client, store
    with socket.socket() as s:  # released: bindable again
        s.bind(("127.0.0.1", reserved.port))

"""The trainer's weight-update store listens on its master address only, and a non-loopback master
(an unauthenticated store on a network) needs the caller's explicit opt-in."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from weight_sync.transports.distributed import WeightGroup

LISTEN = "0A"  # the TCP state column of /proc/net/tcp{,6}


def listening_addresses(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} shows them) of sockets listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, _, state = line.split()[1:4]
            address, hex_port = local.rsplit(":", 1)
            if int(hex_port, 16) == port and state == LISTEN:
                found.append(address)
    return found


def test_a_loopback_master_listens_on_loopback_only():
    group = WeightGroup.host("127.0.0.1", 0, world_size=2, timeout_s=5.0)
    try:
        assert listening_addresses(group.port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 nor ::
        client = dist.TCPStore("127.0.0.1", group.port, 2, False, timeout=datetime.timedelta(seconds=5))
        client.set("k", "v")
        assert group.store.get("k") == b"v"  # the store works through the socket it was handed
    finally:
        group.close()


def test_a_master_beyond_loopback_needs_an_explicit_trusted_network():
    with pytest.raises(ValueError, match="no authentication"):
        WeightGroup.host("0.0.0.0", 0, world_size=2, timeout_s=5.0)
    group = WeightGroup.host("0.0.0.0", 0, world_size=2, timeout_s=5.0, trusted_network=True)
    try:
        assert listening_addresses(group.port) == ["00000000"]  # what was asked for, said out loud
    finally:
        group.close()

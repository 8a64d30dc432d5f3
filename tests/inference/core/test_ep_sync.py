"""The EP group's ZMQ step agreement: element-wise MAX over real sockets (one thread per rank), and
a clear error, never a hang, when a peer is gone or out of step."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from inference.core.ep_sync import EPCommunicator, EPPeerLostError


def address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def group(world: int, timeout_s: float = 5.0) -> list[EPCommunicator]:
    """`world` communicators, connected (each built on its own thread: the handshake blocks)."""
    addr = address()
    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(EPCommunicator, r, world, addr, timeout_s=timeout_s) for r in range(world)]
        return [f.result(timeout=30) for f in futures]


def each(comms, fn):
    """Run `fn(comm)` on every rank at once; the results (or exceptions) by rank."""
    with ThreadPoolExecutor(len(comms)) as pool:
        futures = [pool.submit(fn, c) for c in comms]
        out = []
        for f in futures:
            try:
                out.append(f.result(timeout=30))
            except Exception as exc:  # noqa: BLE001 (returned for the test to check)
                out.append(exc)
        return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_max_reduction_over_many_rounds(world):
    comms = group(world)
    try:
        for step in range(20):
            got = each(comms, lambda c, s=step: c.sync_all_reduce_max([c.rank * s, (world - c.rank) % 3, 7]))
            want = [(world - 1) * step, max((world - r) % 3 for r in range(world)), 7]
            assert got == [want] * world
        assert all(c.round == 20 for c in comms)
    finally:
        for c in comms:
            c.close()


def test_a_silent_peer_fails_the_others_with_its_rank():
    comms = group(3, timeout_s=0.5)
    try:
        results = each(comms[:2], lambda c: c.sync_all_reduce_max([1]))  # rank 2 never arrives
        for exc in results:
            assert isinstance(exc, EPPeerLostError)
            assert "[2]" in str(exc) and "within 0.5 s" in str(exc)
        assert comms[0].closed and comms[1].closed
        with pytest.raises(EPPeerLostError, match="closed"):
            comms[0].sync_all_reduce_max([1])
    finally:
        for c in comms:
            c.close()


def test_a_gone_hub_fails_the_ranks():
    comms = group(2, timeout_s=0.5)
    comms[0].close()  # the hub's socket is gone
    with pytest.raises(EPPeerLostError, match=r"hub \(rank 0\) did not answer"):
        comms[1].sync_all_reduce_max([3])
    comms[1].close()


def test_a_rank_out_of_step_is_refused():
    comms = group(2, timeout_s=2.0)
    try:
        comms[1].round += 1  # as if it had run an extra step on its own
        results = each(comms, lambda c: c.sync_all_reduce_max([1, 2]))
        assert isinstance(results[0], EPPeerLostError) and "out of step" in str(results[0])
        assert isinstance(results[1], EPPeerLostError)
    finally:
        for c in comms:
            c.close()


def test_ranks_that_never_connect_are_named():
    addr = address()
    with pytest.raises(EPPeerLostError, match=r"ranks \[1, 2\] did not connect"):
        EPCommunicator(0, 3, addr, timeout_s=0.3)
    with pytest.raises(EPPeerLostError, match="did not answer"):
        EPCommunicator(1, 2, address(), timeout_s=0.3)  # no hub there


def test_bad_groups_are_refused():
    with pytest.raises(ValueError, match="rank 2"):
        EPCommunicator(2, 2, "tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="timeout_s"):
        EPCommunicator(0, 1, "tcp://127.0.0.1:1", timeout_s=0)

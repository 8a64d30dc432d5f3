"""Who may connect: loopback by default, a shared-secret token or CURVE keys beyond it (refused
otherwise, before the model loads). In-process servers on real loopback sockets."""

from __future__ import annotations

import logging
import secrets

import pytest
import torch

from inference import DynamicInferenceEngine, InferenceConfig
from rollout import ClientSecurity, RolloutClient, ServerSecurity
from rollout.cli import build_parser
from rollout.server.serve import serve_main
from rollout.server.server import RolloutServer, ServerConfig
from rollout.wire.security import InsecureBindError, check_bind, create_keys, is_loopback, public_key
from tests.rollout.service_util import greedy


@pytest.fixture(scope="module")
def engine():
    from tests.rollout.conftest import tiny_policy

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = DynamicInferenceEngine.from_pretrained(tiny_policy(hidden=32, layers=1),
                                                 InferenceConfig(block_size=4, num_blocks=64, max_sequence_length=32))
    yield eng
    torch.set_num_threads(threads)


@pytest.fixture
def serve(engine):
    servers = []

    def start(**config) -> RolloutServer:
        server = RolloutServer(engine, ServerConfig(**config)).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def answers(address: str, security=None) -> bool:
    """Served, or refused at the handshake (PermissionError at once, not a timeout)."""
    with RolloutClient(address, timeout=10.0, security=security, reconnect_after_s=30) as client:
        try:
            return client.health().healthy and len(client.generate([[3, 4, 5]], 1, greedy(2))) == 1
        except PermissionError:
            return False


def test_loopback_only_without_credentials():
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.9", "localhost", "::1", "[::1]"]))
    assert not any(map(is_loopback, ["0.0.0.0", "*", "10.0.0.1", "example.com", "::"]))
    for host in ["0.0.0.0", "10.0.0.1", "*"]:
        with pytest.raises(InsecureBindError, match="--token"):
            check_bind(host, ServerSecurity())
        check_bind(host, ServerSecurity(token="t"))
    with pytest.raises(ValueError, match="curve_clients"):
        ServerSecurity(curve_keys="k")


def test_serve_refuses_a_public_address_without_credentials_before_loading(capsys, monkeypatch):
    monkeypatch.delenv("ROLLOUT_TOKEN", raising=False)
    args = build_parser().parse_args(["serve", "--model", "/nonexistent", "--host", "0.0.0.0"])
    assert serve_main(args) == 2  # the model path is never read
    assert "refusing to listen on '0.0.0.0'" in capsys.readouterr().err


def test_token(serve):
    server = serve(host="0.0.0.0", security=ServerSecurity(token="s3cret"))  # all interfaces: needs the token
    address = server.address.replace("0.0.0.0", "127.0.0.1")
    assert answers(address, ClientSecurity(token="s3cret"))
    assert not answers(address, ClientSecurity(token="wrong"))
    assert not answers(address)


def test_the_token_reaches_no_log_at_any_level(serve, caplog):
    token = "tok-" + secrets.token_hex(8)
    caplog.set_level(logging.DEBUG)  # NOTE: pyzmq's ZAP handler logs the passwords it accepts at DEBUG
    server = serve(security=ServerSecurity(token=token))
    assert answers(server.address, ClientSecurity(token=token))
    assert not answers(server.address, ClientSecurity(token=token[:-1]))  # a prefix of it is not it
    assert not answers(server.address, ClientSecurity(token=token + "x"))
    assert any("PLAIN" in r.getMessage() for r in caplog.records)  # the handler did log, at DEBUG
    for record in caplog.records:
        assert token not in record.getMessage() and token not in repr(record.args), record.getMessage()


def test_curve_keys(serve, tmp_path):
    server_public, server_secret = create_keys(tmp_path / "server", "server")
    _, alice = create_keys(tmp_path / "clients", "alice")  # the accepted directory holds alice.key
    (tmp_path / "clients" / "alice.key_secret").rename(tmp_path / "alice.key_secret")
    _, mallory = create_keys(tmp_path / "others", "mallory")
    server = serve(security=ServerSecurity(curve_keys=server_secret, curve_clients=tmp_path / "clients"))
    key = public_key(server_public)
    assert answers(server.address, ClientSecurity(curve_keys=tmp_path / "alice.key_secret", server_public_key=key))
    assert not answers(server.address, ClientSecurity(curve_keys=mallory, server_public_key=key))
    assert not answers(server.address)

"""A server's KV pool when no size is given: 4 GiB (vLLM CPU's long-standing default), at most a
quarter of the memory free at start; an explicit size is taken as given."""

from __future__ import annotations

from rollout.cli import build_parser
from rollout.server.serve import SERVER_KV_BYTES, build_engine, server_kv_bytes

GIB = 2**30


def test_the_default_is_four_gib_at_most_a_quarter_of_the_free_memory():
    assert SERVER_KV_BYTES == 4 * GIB
    assert server_kv_bytes(None, None, free_bytes=64 * GIB) == 4 * GIB
    assert server_kv_bytes(None, None, free_bytes=8 * GIB) == 2 * GIB


def test_an_explicit_size_is_taken_as_given():
    assert server_kv_bytes(None, 3 * GIB, free_bytes=8 * GIB) == 3 * GIB
    assert server_kv_bytes(100, None, free_bytes=8 * GIB) is None  # NOTE: the block count sizes the pool


def test_a_server_built_without_a_size_holds_the_default_pool(service_model_dir, monkeypatch):
    # NOTE: the free memory pinned, so that the size this test expects and the server's are read alike
    monkeypatch.setattr("rollout.server.serve.free_memory_bytes", lambda: 64 * GIB)
    args = build_parser().parse_args(["serve", "--model", str(service_model_dir), "--max-seq-len", "64"])
    want = server_kv_bytes(None, None)
    stats = build_engine(args).stats()
    block = stats["kv_cache_bytes"] // stats["total_blocks"]
    assert want - block < stats["kv_cache_bytes"] <= want  # NOTE: whole blocks

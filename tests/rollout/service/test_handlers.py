"""One handler per message kind per side: each side's table keyed by message class covers every
kind it can be sent, and nothing else (a kind added to the wire without a handler on one side is
refused when that side is built, not found at run time)."""

from __future__ import annotations

import typing

import pytest

from inference import DynamicInferenceEngine
from rollout import RolloutRouter
from rollout.client.streams import _ON_REPLY
from rollout.router.replicas import _ATTEMPT_REPLIES
from rollout.server.server import RolloutServer
from rollout.service.endpoint import EndpointConfig, ServiceEndpoint
from rollout.wire.kinds import REPLY_KINDS, REQUEST_KINDS
from rollout.wire.messages import BROADCAST_KINDS, REQUEST_TYPES, Generate, ReplyMessage, Result, kind_of
from tests.rollout.conftest import small_engine_config, tiny_policy

REPLY_TYPES = typing.get_args(ReplyMessage)


def test_every_kind_is_one_message_class():
    assert sorted(kind_of(t) for t in REQUEST_TYPES) == sorted(REQUEST_KINDS)
    assert sorted(kind_of(t) for t in REPLY_TYPES) == sorted(REPLY_KINDS)


def test_server_and_router_have_one_handler_for_every_request_kind():
    engine = DynamicInferenceEngine.from_pretrained(tiny_policy(hidden=32, layers=1), small_engine_config())
    server, router = RolloutServer(engine), RolloutRouter()
    try:
        for side in (server, router):
            handlers = side.endpoint.handlers
            assert set(handlers) == set(REQUEST_TYPES), side
            assert handlers[Generate] == side.endpoint._generate  # exactly-once lives in the endpoint alone
            assert all(callable(h) for h in handlers.values())
        broadcast = {kind_of(t) for t, h in router.endpoint.handlers.items() if h == router._broadcast}
        assert broadcast == BROADCAST_KINDS  # the router's own: Generate, Abort, Health, Heartbeat, KvEvents
    finally:
        server.close()
        router.close()


def test_generate_replies_have_one_handler_on_the_client_and_the_router():
    # a Generate is answered by samples, token deltas or a refusal; a Result answers control calls
    for table in (_ON_REPLY, _ATTEMPT_REPLIES):
        assert set(table) == set(REPLY_TYPES) - {Result}


@pytest.mark.parametrize("drop", [None, "one"])
def test_an_endpoint_refuses_a_table_missing_a_kind_or_with_a_stranger(drop):
    handlers = {t: (lambda peer, msg, now: None) for t in REQUEST_TYPES if t is not Generate}
    if drop:
        handlers.pop(next(iter(handlers)))
    else:
        handlers[Result] = lambda peer, msg, now: None
    with pytest.raises(ValueError, match="no handler for|non-requests"):
        ServiceEndpoint(EndpointConfig(), name="t", handlers=handlers, start_generate=lambda *a: None,
                        abort_silent=lambda *a: None)

"""`KVEventHub`: pending stored events, removals, clears, listeners, draining."""

import logging

from inference.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventHub


def _stored(hashes, parent=0, ids=None):
    return BlockStored(tuple(hashes), parent, tuple(ids if ids is not None else range(len(hashes))), 4)


def test_a_hub_without_consumers_records_nothing():
    hub = KVEventHub()
    assert not hub.enabled
    hub.queue_stored(_stored([11]))
    hub.publish_pending()
    hub.blocks_removed([11])
    hub.all_cleared()
    assert hub.take_events() == []


def test_stored_events_wait_until_published_in_order():
    hub = KVEventHub(record=True)
    first, second = _stored([11, 12]), _stored([21], parent=12, ids=[5])
    hub.queue_stored(first)
    hub.queue_stored(second)
    assert hub.take_events() == []
    hub.publish_pending()
    assert hub.take_events() == [first, second]
    hub.publish_pending()
    assert hub.take_events() == []


def test_discard_pending_drops_them_for_good():
    hub = KVEventHub(record=True)
    hub.queue_stored(_stored([11]))
    hub.discard_pending()
    hub.publish_pending()
    assert hub.take_events() == []


def test_removing_published_hashes_announces_them_sorted():
    hub = KVEventHub(record=True)
    hub.queue_stored(_stored([13, 11, 12]))
    hub.publish_pending()
    hub.take_events()
    hub.blocks_removed([12, 11, 12])
    hub.blocks_removed([])
    assert hub.take_events() == [BlockRemoved((11, 12))]


def test_removing_pending_hashes_trims_the_pending_event_silently():
    hub = KVEventHub(record=True)
    hub.queue_stored(_stored([11, 12], ids=[0, 1]))
    hub.queue_stored(_stored([21], ids=[2]))
    hub.blocks_removed([12, 21])
    assert hub.take_events() == []
    hub.publish_pending()
    assert hub.take_events() == [BlockStored((11,), 0, (0,), 4)]


def test_removal_of_mixed_published_and_pending_hashes():
    hub = KVEventHub(record=True)
    hub.queue_stored(_stored([11]))
    hub.publish_pending()
    hub.queue_stored(_stored([21], ids=[1]))
    hub.take_events()
    hub.blocks_removed([11, 21])
    assert hub.take_events() == [BlockRemoved((11,))]
    hub.publish_pending()
    assert hub.take_events() == []


def test_a_discarded_hash_is_never_announced_as_removed():
    hub = KVEventHub(record=True)
    hub.queue_stored(_stored([11]))
    hub.discard_pending()
    hub.blocks_removed([11])
    assert hub.take_events() == []


def test_all_cleared_drops_pending_and_is_announced():
    hub = KVEventHub(record=True)
    hub.queue_stored(_stored([11]))
    hub.all_cleared()
    hub.publish_pending()
    assert hub.take_events() == [AllBlocksCleared()]


def test_take_events_drains():
    hub = KVEventHub(record=True)
    hub.all_cleared()
    assert hub.take_events() == [AllBlocksCleared()]
    assert hub.take_events() == []


def test_a_listener_alone_enables_the_hub_and_drains_nothing():
    hub = KVEventHub()
    seen = []
    hub.add_listener(seen.append)
    assert hub.enabled
    hub.queue_stored(_stored([11]))
    hub.publish_pending()
    assert seen == [_stored([11])]
    assert hub.take_events() == []  # record=False: listeners only


def test_a_raising_listener_is_logged_and_stops_nothing(caplog):
    hub = KVEventHub(record=True)
    seen = []

    def broken(event):
        raise RuntimeError("router down")

    hub.add_listener(broken)
    hub.add_listener(seen.append)
    with caplog.at_level(logging.ERROR, logger="inference.kv_cache.events"):
        hub.queue_stored(_stored([11]))
        hub.publish_pending()
        hub.blocks_removed([11])
        hub.all_cleared()
    expected = [_stored([11]), BlockRemoved((11,)), AllBlocksCleared()]
    assert seen == expected
    assert hub.take_events() == expected
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 3
    assert all(r.exc_info and isinstance(r.exc_info[1], RuntimeError) for r in errors)

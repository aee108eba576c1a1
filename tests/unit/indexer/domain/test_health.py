"""StreamHealth: how a report folds into a stream's record."""

from __future__ import annotations

from kvindex.indexer.domain.health import StreamCounters, StreamHealth, StreamReport


def test_counters_add_and_the_rest_replaces_only_when_set() -> None:
    health = StreamHealth()
    health.update(StreamReport(num_batches=2, num_gaps=1, last_seq=4, last_event_ts=9.5), 10.0)
    health.update(StreamReport(num_batches=3, block_size=16, replaying=True), 11.0)
    assert (health.num_batches, health.num_gaps) == (5, 1)
    assert (health.last_seq, health.last_event_ts, health.lag_s) == (4, 9.5, 0.5)
    assert health.last_heard == 10.0  # nothing was applied at 11.0
    assert (health.block_size, health.replaying) == (16, True)
    health.update(StreamReport(replaying=False), 12.0)
    assert (health.block_size, health.replaying) == (16, False)


def test_a_disconnect_is_timed_by_the_record_and_a_connect_clears_it() -> None:
    health = StreamHealth()
    health.update(StreamReport(connected=True), 1.0)
    assert (health.connected, health.disconnected_at) == (True, None)
    health.update(StreamReport(connected=False), 2.0)
    assert (health.connected, health.disconnected_at) == (False, 2.0)
    health.update(StreamReport(connected=True), 3.0)
    assert health.disconnected_at is None


def test_lag_is_never_negative() -> None:
    health = StreamHealth()
    health.update(StreamReport(last_seq=0, last_event_ts=5.0), 4.0)  # engine clock ahead
    assert health.lag_s == 0.0


def test_every_counter_adds_and_errors_are_what_an_operator_reads_as_such() -> None:
    names = [name for name in StreamCounters.__dataclass_fields__]
    one = StreamCounters(**dict.fromkeys(names, 1))
    total = StreamCounters()
    total.add(one)
    total.add(one)
    assert total == StreamCounters(**dict.fromkeys(names, 2))
    assert StreamCounters(num_decode_errors=1, num_bad_events=2, num_store_errors=4).num_errors == 7


def test_a_replayed_batch_moves_the_position_but_not_the_lag() -> None:
    health = StreamHealth()
    health.update(StreamReport(last_seq=3, last_event_ts=9.0), 10.0)  # live: 1 s behind
    replayed = StreamReport(last_seq=9, last_event_ts=30.0, last_replayed=True)
    health.update(replayed, 700.0)  # events published 670 s ago, replayed now
    assert (health.last_seq, health.last_event_ts, health.last_heard) == (9, 30.0, 700.0)
    assert health.lag_s == 1.0
    health.update(StreamReport(last_seq=10, last_event_ts=700.5), 700.75)
    assert health.lag_s == 0.25

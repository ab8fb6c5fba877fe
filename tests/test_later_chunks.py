"""The rules for which later prefill chunks replay CUDA graphs (`engine.backends.later_chunks`,
the bookkeeping of `cupy_prefill_graph`), on any machine."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from engine.backends.later_chunks import LATER_KEEP, SEEN_KEEP, Sightings, keep_recent, later_bucket

pytestmark = pytest.mark.timeout(30)


def test_a_later_chunk_is_padded_to_sixteen_tokens_within_the_limit() -> None:
    """Chunks at a start above 0 of 2..later_max tokens get a padded length, capped at later_max;
    first chunks, single tokens, longer chunks and graphs turned off (later_max 0) get none."""
    assert later_bucket(72, 1987, 128) == 80
    assert later_bucket(16, 5, 128) == 16 and later_bucket(17, 5, 128) == 32
    assert later_bucket(60, 5, 64) == 64 and later_bucket(50, 5, 50) == 50  # never past the limit
    assert later_bucket(72, 0, 128) is None  # a first chunk
    assert later_bucket(1, 5, 128) is None  # one token: the decode step
    assert later_bucket(129, 5, 128) is None
    assert later_bucket(72, 5, 0) is None


def test_a_start_is_due_at_its_second_sighting_or_at_once_when_named() -> None:
    """A start is due the second time a chunk begins there, or the first time once `expect`
    named it; start 0 cannot be named."""
    s = Sightings(128)
    assert not s.due(40, 100) and s.due(40, 100)
    s.expect(300)
    assert s.due(40, 300)
    s.expect(0)
    assert not s.due(40, 0)


def test_a_full_length_chunk_is_due_only_at_a_named_start() -> None:
    """A chunk as long as the limit (the middle of a prompt prefilled in such chunks) is never due
    by sightings alone, so a long prompt's chunks do not cycle through the kept graphs; at a named
    start it is."""
    s = Sightings(64)
    starts = range(64, 64 * 12, 64)  # a 768-token prompt in 64-token chunks, prefilled twice
    assert not any(s.due(64, st) for _ in range(2) for st in starts)
    assert s.due(20, 64 * 12) is False and s.due(20, 64 * 12) is True  # its last, shorter chunk
    s.expect(64)
    assert s.due(64, 64)


def test_sightings_and_kept_graphs_are_bounded() -> None:
    """At most SEEN_KEEP starts are remembered (the oldest forgotten), and `keep_recent` keeps the
    most recently used LATER_KEEP entries."""
    s = Sightings(128)
    for st in range(1, SEEN_KEEP + 2):
        s.due(10, st)
    assert not s.due(10, 1)  # forgotten: the first sighting again
    assert s.due(10, SEEN_KEEP + 1)
    entries: OrderedDict[int, str] = OrderedDict((i, str(i)) for i in range(LATER_KEEP + 3))
    entries.move_to_end(0)  # used recently
    keep_recent(entries, LATER_KEEP)
    assert len(entries) == LATER_KEEP and 0 in entries and 1 not in entries

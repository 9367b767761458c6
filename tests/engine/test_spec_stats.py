"""A request's speculation counters: acceptance by draft position needs both what each position
drafted and what it accepted."""

from __future__ import annotations

from streamsd.request import SpecStats


def test_spec_stats_count_drafts_and_accepts_per_position():
    stats = SpecStats()
    stats.record(drafted=4, accepted=2, emitted=3)
    stats.record(drafted=0, accepted=0, emitted=1)  # a step that did not speculate
    stats.record(drafted=2, accepted=2, emitted=3)
    stats.record(drafted=4, accepted=0, emitted=1)
    d = stats.as_dict()
    assert d["drafted_per_position"] == [3, 3, 2, 2]
    assert d["accepted_per_position"] == [2, 2, 0, 0]
    assert sum(d["drafted_per_position"]) == d["drafted"] == 10
    assert sum(d["accepted_per_position"]) == d["accepted"] == 4

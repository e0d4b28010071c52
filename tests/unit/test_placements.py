"""The engine client's request bookkeeping: which requests a lost or restarted engine core had
(those sent to it in an earlier epoch than its current one, when it restarted), and what
detaching (a request parked for resumption) and untracking (it ended) leave behind."""

from __future__ import annotations

from shoal.bus.messages.sampling import OutputKind
from shoal.engine.client.collector import RequestOutputCollector
from shoal.engine.client.placements import RequestPlacements


def _placements() -> RequestPlacements:
    placements = RequestPlacements()
    for request_id, engine_id, epoch in [("old", "e0", 0), ("new", "e0", 1), ("other", "e1", 0)]:
        placements.track(request_id, RequestOutputCollector(OutputKind.DELTA))
        placements.place(request_id, engine_id, epoch)
    return placements


def test_a_restart_dooms_only_the_requests_sent_before_it() -> None:
    placements = _placements()
    assert placements.on_engine("e0", sent_before=1) == ["old"]  # restarted into epoch 1
    assert placements.on_engine("e0") == ["old", "new"]  # lost: every request on it
    assert placements.on_engine("e0", sent_before=0) == []


def test_detached_requests_keep_their_collector_and_untracked_ones_are_gone() -> None:
    placements = _placements()
    assert placements.detach("old") == "e0"
    assert "old" in placements and placements.engine_of("old") is None
    assert placements.placed() == {"new": "e0", "other": "e1"}
    collector, engine_id = placements.untrack("new")
    assert collector is not None and engine_id == "e0"
    assert "new" not in placements and placements.request_ids() == ["old", "other"]

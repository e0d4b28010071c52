"""The injected link latency of ``EPContext.link_delay_s`` (benchmarks only), on a fake clock and
a fake collective: an all-to-all's result is handed over no earlier than its issue time plus the
delay, and a wait that comes later (the other micro-batch computed meanwhile) does not sleep."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shoal.workers.moe import expert_parallel
from shoal.workers.moe.expert_parallel import EPContext, PendingAllToAll, start_all_to_all


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class FakeWork:
    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock(100.0)
    monkeypatch.setattr(expert_parallel.time, "perf_counter", fake.perf_counter)
    monkeypatch.setattr(expert_parallel.time, "sleep", fake.sleep)
    return fake


def test_the_delay_is_not_negative() -> None:
    assert EPContext(0, 2, link_delay_s=0.25).link_delay_s == 0.25
    for bad in (-0.001, float("nan")):
        with pytest.raises(ValueError, match="link_delay_s must be >= 0"):
            EPContext(0, 2, link_delay_s=bad)


def test_an_all_to_all_is_ready_at_its_issue_time_plus_the_delay(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    issued: list[dict[str, Any]] = []

    def fake_all_to_all_single(recv: torch.Tensor, send: torch.Tensor, **kw: Any) -> FakeWork:
        issued.append(kw)
        recv.copy_(send)
        return FakeWork()

    monkeypatch.setattr(expert_parallel.dist, "all_to_all_single", fake_all_to_all_single)
    pending = start_all_to_all(torch.arange(3.0), [3], [3], EPContext(0, 1, link_delay_s=0.5))
    assert issued[0]["async_op"] is True
    assert pending.ready_at == 100.5
    clock.now = 100.2  # the other micro-batch computed for 0.2 s
    assert pending.wait().tolist() == [0.0, 1.0, 2.0]
    assert clock.sleeps == [pytest.approx(0.3)] and clock.now == pytest.approx(100.5)


def test_a_wait_after_the_delay_does_not_sleep(clock: FakeClock) -> None:
    work = FakeWork()
    pending = PendingAllToAll(torch.ones(2), torch.ones(2), work, ready_at=100.5)
    clock.now = 100.7
    pending.wait()
    pending.wait()  # a second wait does not wait on the collective again
    assert clock.sleeps == [] and work.waits == 1


def test_without_a_delay_the_wait_returns_once_the_collective_is_done(clock: FakeClock) -> None:
    work = FakeWork()
    pending = PendingAllToAll(torch.ones(2), torch.ones(2), work, ready_at=clock.now)
    pending.wait()
    assert clock.sleeps == [] and work.waits == 1


def test_with_a_bandwidth_transfers_to_other_ranks_queue_on_the_link(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """100 bytes/s and 0.5 s latency: rows for other ranks take their bytes' time, one transfer
    after another on this rank's link; rows for this rank cost no link time."""
    monkeypatch.setattr(expert_parallel.dist, "all_to_all_single", lambda *a, **k: FakeWork())
    monkeypatch.setattr(expert_parallel, "INJECTED_LINK", expert_parallel.InjectedLink())
    ep = EPContext(0, 2, link_delay_s=0.5, link_bytes_per_s=100.0)
    rows = torch.zeros(5, 5)  # 20 bytes a row
    first = start_all_to_all(rows, [1, 4], [1, 4], ep)  # 4 rows = 80 bytes away: 0.8 s
    second = start_all_to_all(rows, [3, 2], [3, 2], ep)  # 40 bytes, after the first: 0.4 s
    local = start_all_to_all(rows, [5, 0], [5, 0], ep)  # all for this rank: no link time
    assert first.ready_at == pytest.approx(100.0 + 0.8 + 0.5)
    assert second.ready_at == pytest.approx(100.0 + 0.8 + 0.4 + 0.5)
    assert local.ready_at == pytest.approx(100.0 + 0.5)  # nothing on the link: the latency
    assert expert_parallel.INJECTED_LINK.bytes_sent == 120
    with pytest.raises(ValueError, match="link_bytes_per_s must be >= 0"):
        EPContext(0, 2, link_bytes_per_s=-1.0)

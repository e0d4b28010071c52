"""The acceptance-driven K controller (``engine/core/spec_k.py``) on scripted acceptance."""

from __future__ import annotations

import itertools

from shoal.engine.core.spec_k import AcceptanceController


def feed(controller: AcceptanceController, steps: int, accepted: int, rejections: int) -> list[int]:
    ks = []
    for _ in range(steps):
        controller.observe(accepted, rejections)
        ks.append(controller.choose(controller.max_k))
    return ks


def test_k_drops_when_drafts_stop_being_accepted_and_rises_again() -> None:
    controller = AcceptanceController(max_k=5)
    high = feed(controller, 30, accepted=9, rejections=1)  # alpha -> 0.9
    assert high[-1] == 5
    low = feed(controller, 60, accepted=0, rejections=4)  # nothing accepted
    assert low[-1] == 0 and controller.k == 0
    # K waits out the patience, then goes straight to the target: few changes, and never two
    # within the patience (the K=1 probes at K=0 aside).
    ks = [k for k in high + low if k != 1]
    changes = [i for i in range(1, len(ks)) if ks[i] != ks[i - 1]]
    assert all(b - a >= controller.patience for a, b in itertools.pairwise(changes))
    assert len(changes) <= 6
    back = feed(controller, 80, accepted=9, rejections=1)
    assert back[-1] == 5


def test_one_noisy_step_does_not_flip_k() -> None:
    controller = AcceptanceController(max_k=4)
    feed(controller, 20, accepted=9, rejections=1)
    assert controller.k == 4
    controller.observe(0, 5)  # one bad step among good ones
    for _ in range(10):
        controller.observe(9, 1)
        assert controller.k == 4  # patience: the target must point down 3 steps in a row


def probe_gaps(controller: AcceptanceController, steps: int, accepted: int = 0) -> list[int]:
    """Steps between the K = 1 probes chosen over ``steps`` steps at K = 0, each probe answered
    with ``accepted`` accepted drafts (a rejection otherwise)."""
    probes = []
    for step in range(steps):
        if controller.choose(5):
            probes.append(step)
            controller.observe(accepted, 0 if accepted else 1)
    return [b - a for a, b in itertools.pairwise([-1, *probes])]


def test_k_is_bounded_by_the_table_and_probes_at_zero_less_often_while_probes_fail() -> None:
    controller = AcceptanceController(max_k=5, probe_every=4, max_probe_every=16)
    assert controller.choose(2) == 2
    for _ in range(10):
        controller.observe(0, 3)
    assert controller.k == 0
    assert probe_gaps(controller, 60) == [4, 8, 16, 16, 16]  # doubles per failed probe
    assert controller.choose(0) == 0  # the table's 0 wins over a probe
    for _ in range(4):  # drafts accepted again (as probes would see): K leaves 0
        controller.observe(4, 0)
    assert controller.k > 0
    for _ in range(10):
        controller.observe(0, 3)
    assert controller.k == 0
    assert probe_gaps(controller, 12)[:2] == [4, 8]  # back to the first wait


def test_a_big_step_weighs_as_many_small_ones() -> None:
    big, small = AcceptanceController(max_k=5), AcceptanceController(max_k=5)
    big.observe(0, 64)  # 64 requests, every draft rejected: 16 observations' worth
    small.observe(0, 4)  # one request's worth
    assert big.k == 0 and big.target() == 0
    assert small.k == 5  # one small step is within the patience
    big.observe(2, 1)  # ... while a small step after it weighs as one
    assert big.k == 0


def test_steps_without_drafts_change_nothing() -> None:
    controller = AcceptanceController(max_k=3)
    alpha = controller.alpha
    feed(controller, 10, accepted=0, rejections=0)
    assert controller.alpha == alpha and controller.k == 3


def test_target_follows_the_worth_rule() -> None:
    controller = AcceptanceController(max_k=8, worth=0.35)
    for alpha, expected in ((0.9, 8), (0.7, 2), (0.5, 1), (0.3, 0), (1.0, 8), (0.0, 0)):
        controller.alpha = alpha
        assert controller.target() == expected, alpha


def test_a_workload_that_turns_is_followed_within_a_few_steps() -> None:
    controller = AcceptanceController(max_k=5)
    feed(controller, 30, accepted=9, rejections=1)
    assert controller.k == 5
    feed(controller, 10, accepted=0, rejections=4)  # drafts stop being accepted
    assert controller.k <= 1  # not one unit of K per patience (that would still be at 3)
    feed(controller, 12, accepted=9, rejections=1)
    assert controller.k == 5


def test_drafts_worth_verifying_are_k_or_a_probe_s_one() -> None:
    controller = AcceptanceController(max_k=4)
    assert controller.num_worth_verifying() == 4
    for _ in range(6):
        controller.observe(num_accepted=0, num_rejections=4)
    assert controller.k == 0 and controller.num_worth_verifying() == 0
    while controller.choose(bound=4) == 0:
        assert controller.num_worth_verifying() == 0
    assert controller.num_worth_verifying() == 1  # the probe's draft awaits its verdict
    controller.observe(num_accepted=0, num_rejections=1)
    assert controller.num_worth_verifying() == 0

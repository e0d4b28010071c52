"""The recovery policy (pure, no bus): when the controller sends ``retry`` to which engine core,
how it backs off, when it gives up, and what ends a fault. Time is passed in."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.bus.messages.control import ActorState
from shoal.config.deployment import FaultToleranceConfig
from shoal.engine.recovery.policy import Decision, GiveUp, RecoveryPolicy, RetryLimits, SendRetry

READY, UNHEALTHY, DEAD = ActorState.READY, ActorState.UNHEALTHY, ActorState.DEAD
LIMITS = RetryLimits(max_retries=3, backoff_s=1.0, max_backoff_s=3.0, settle_s=0.5)
E0 = "engine-0"


def fresh(limits: RetryLimits = LIMITS) -> RecoveryPolicy:
    return RecoveryPolicy(limits)


def only_retry(decisions: list[Decision], engine_id: str = E0) -> SendRetry:
    assert len(decisions) == 1 and isinstance(decisions[0], SendRetry), decisions
    assert decisions[0].engine_id == engine_id
    return decisions[0]


def fail(policy: RecoveryPolicy, retry: SendRetry, now: float, why: str = "rejected") -> None:
    policy.on_result(retry.engine_id, retry.ticket, False, why, now)


def test_limits_come_from_the_fault_tolerance_config():
    ft = FaultToleranceConfig(recovery_max_retries=7, recovery_backoff_s=0.2)
    limits = RetryLimits.from_config(ft)
    assert (limits.max_retries, limits.backoff_s, limits.max_backoff_s) == (7, 0.2, 10.0)


@pytest.mark.parametrize(("failures", "wait"), [(1, 1.0), (2, 2.0), (3, 3.0), (4, 3.0), (10, 3.0)])
def test_backoff_doubles_up_to_its_cap(failures, wait):
    assert LIMITS.backoff(failures) == wait


def test_a_fresh_policy_retries_an_unhealthy_heartbeat_at_once():
    policy = fresh()
    policy.observe(E0, UNHEALTHY, 100.0, incarnation="a")
    retry = only_retry(policy.poll(100.0))
    assert retry.attempt == 1 and policy.num_retries_sent == 1


@pytest.mark.parametrize("state", [READY, ActorState.STARTING, ActorState.STOPPED])
def test_engines_that_are_not_faulted_get_nothing(state):
    policy = fresh()
    policy.observe(E0, state, 0.0, incarnation="a", is_status=True)
    assert policy.poll(0.0) == [] and policy.poll(1000.0) == []


def test_one_retry_in_flight_per_engine_core():
    policy = fresh()
    policy.observe(E0, UNHEALTHY, 0.0, is_status=True)
    only_retry(policy.poll(0.0))
    policy.observe(E0, UNHEALTHY, 0.1)  # its heartbeat, while the retry is in flight
    assert policy.poll(50.0) == []


def test_failed_retries_back_off_then_give_up_once():
    policy = fresh()
    policy.observe(E0, UNHEALTHY, 0.0, reason="boom", is_status=True)
    now = 0.0
    for attempt in (1, 2, 3):
        retry = only_retry(policy.poll(now))
        assert retry.attempt == attempt
        now += 0.25
        fail(policy, retry, now, f"no {attempt}")
        if attempt < 3:  # not before the backoff, then at once
            now += LIMITS.backoff(attempt)
            assert policy.poll(now - 0.01) == []
    assert policy.poll(now) == [GiveUp(E0, 3, "boom", "no 3")]
    assert policy.poll(now + 100) == []
    assert (policy.num_retries_sent, policy.num_retries_failed, policy.num_given_up) == (3, 3, 1)


def test_gives_up_right_after_the_last_failure():
    policy = fresh(RetryLimits(max_retries=1, backoff_s=5.0, max_backoff_s=5.0))
    policy.observe(E0, UNHEALTHY, 0.0)
    fail(policy, only_retry(policy.poll(0.0)), 1.0)
    assert [type(d) for d in policy.poll(1.0)] == [GiveUp]


def test_a_dead_engine_core_is_waited_for_then_retried_when_unhealthy():
    policy = fresh()
    policy.observe(E0, DEAD, 0.0, reason="worker-0-0 gone", is_status=True)
    assert policy.poll(0.0) == [] and policy.poll(500.0) == []
    policy.observe(E0, UNHEALTHY, 501.0, reason="worker-0-0 gone", is_status=True)
    assert only_retry(policy.poll(501.0)).attempt == 1


def test_a_retry_that_leaves_it_dead_counts_for_the_same_fault():
    policy = fresh()
    policy.observe(E0, UNHEALTHY, 0.0, is_status=True)
    retry = only_retry(policy.poll(0.0))
    policy.observe(E0, DEAD, 0.5, is_status=True)
    fail(policy, retry, 0.6, "a worker died")
    assert policy.poll(10.0) == []
    policy.observe(E0, UNHEALTHY, 20.0, is_status=True)
    assert only_retry(policy.poll(20.0)).attempt == 2


@pytest.mark.parametrize("how", ["ready", "new incarnation", "stopped"])
def test_a_fault_ends_and_the_next_one_counts_from_one(how):
    policy = fresh()
    policy.observe(E0, UNHEALTHY, 0.0, incarnation="a", is_status=True)
    for t in (0.0, 2.0, 5.0):
        fail(policy, only_retry(policy.poll(t)), t + 0.5)
    assert [type(d) for d in policy.poll(9.0)] == [GiveUp]
    if how == "ready":
        policy.observe(E0, READY, 10.0, incarnation="a")
    elif how == "stopped":
        policy.observe(E0, ActorState.STOPPED, 10.0, incarnation="a", is_status=True)
    else:
        policy.observe(E0, ActorState.STARTING, 10.0, incarnation="b", is_status=True)
    assert policy.poll(10.0) == []
    incarnation = "a" if how != "new incarnation" else "b"
    policy.observe(E0, UNHEALTHY, 11.0, incarnation=incarnation, is_status=True)
    assert only_retry(policy.poll(11.0)).attempt == 1


def test_a_new_incarnation_that_is_already_unhealthy_is_retried_at_once():
    policy = fresh()
    policy.observe(E0, UNHEALTHY, 0.0, incarnation="a")
    fail(policy, only_retry(policy.poll(0.0)), 0.1)
    policy.observe(E0, UNHEALTHY, 0.2, incarnation="b")  # restarted, faulted again
    assert only_retry(policy.poll(0.2)).attempt == 1


def test_late_messages_of_a_retired_incarnation_are_ignored():
    policy = fresh()
    policy.observe(E0, READY, 0.0, incarnation="a")
    policy.observe(E0, READY, 1.0, incarnation="b")
    policy.observe(E0, UNHEALTHY, 1.1, incarnation="a", is_status=True)
    assert policy.poll(1.1) == []


def test_a_successful_retry_ends_the_fault():
    policy = fresh()
    policy.observe(E0, UNHEALTHY, 0.0, is_status=True)
    retry = only_retry(policy.poll(0.0))
    policy.on_result(E0, retry.ticket, True, "", 1.0)
    assert policy.poll(100.0) == [] and policy.num_retries_succeeded == 1
    assert policy.engines[E0].state is READY


def test_after_a_success_a_stale_heartbeat_is_ignored_but_a_status_event_is_not():
    policy = fresh()
    policy.observe(E0, UNHEALTHY, 0.0, is_status=True)
    policy.on_result(E0, only_retry(policy.poll(0.0)).ticket, True, "", 1.0)
    policy.observe(E0, UNHEALTHY, 1.2)  # a heartbeat sent before the reply
    assert policy.poll(1.2) == []
    policy.observe(E0, UNHEALTHY, 1.3, is_status=True)  # a new fault
    assert only_retry(policy.poll(1.3)).attempt == 1


def test_an_unhealthy_heartbeat_after_the_settle_time_is_a_fault():
    policy = fresh()
    policy.observe(E0, UNHEALTHY, 0.0, is_status=True)
    policy.on_result(E0, only_retry(policy.poll(0.0)).ticket, True, "", 1.0)
    policy.observe(E0, UNHEALTHY, 1.0 + LIMITS.settle_s)
    assert only_retry(policy.poll(1.6)).attempt == 1


def test_results_of_unknown_or_finished_retries_change_nothing():
    policy = fresh()
    policy.observe(E0, UNHEALTHY, 0.0, is_status=True)
    retry = only_retry(policy.poll(0.0))
    policy.on_result(E0, retry.ticket + 1, True, "", 0.1)
    policy.on_result("engine-9", retry.ticket, True, "", 0.1)
    assert policy.poll(0.1) == [] and policy.engines[E0].in_flight == retry.ticket
    fail(policy, retry, 0.2)
    fail(policy, retry, 0.3)  # twice: counted once
    assert policy.num_retries_failed == 1


def test_a_failure_of_an_earlier_fault_does_not_delay_the_current_one():
    policy = fresh()
    policy.observe(E0, UNHEALTHY, 0.0, incarnation="a", is_status=True)
    retry = only_retry(policy.poll(0.0))
    policy.observe(E0, UNHEALTHY, 0.5, incarnation="b", is_status=True)
    fail(policy, retry, 0.6)  # the old process's answer
    assert only_retry(policy.poll(0.6)).attempt == 1


def test_engine_cores_recover_independently():
    policy = fresh()
    policy.observe("engine-0", UNHEALTHY, 0.0, is_status=True)
    policy.observe("engine-1", READY, 0.0)
    policy.observe("engine-2", UNHEALTHY, 0.0, is_status=True)
    decisions = policy.poll(0.0)
    assert sorted(d.engine_id for d in decisions) == ["engine-0", "engine-2"]
    by_id = {d.engine_id: d for d in decisions if isinstance(d, SendRetry)}
    fail(policy, by_id["engine-0"], 0.1)
    policy.on_result("engine-2", by_id["engine-2"].ticket, True, "", 0.1)
    assert policy.poll(0.5) == []
    assert only_retry(policy.poll(1.1), "engine-0").attempt == 2


# -- properties over random event sequences ----------------------------------------------------

EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("observe"), st.sampled_from(list(ActorState)), st.booleans()),
        st.tuples(st.just("restart"), st.sampled_from([READY, UNHEALTHY, DEAD]), st.booleans()),
        st.tuples(st.just("result"), st.booleans(), st.booleans()),
        st.tuples(st.just("wait"), st.sampled_from([0.1, 0.5, 1.0, 4.0]), st.booleans()),
    ),
    max_size=60,
)


@dataclass
class FaultSeen:
    num_sent: int = 0
    num_given_up: int = 0
    last_failure_at: float | None = None


@settings(max_examples=300, deadline=None)
@given(events=EVENTS)
def test_retries_respect_state_limits_and_backoff(events):
    """Whatever the engine core reports and whatever the retries answer: a retry goes only to
    an engine core last seen UNHEALTHY, never two at once, at most ``max_retries`` per fault,
    never before the backoff of that fault's failures so far; a fault gives up once, and only
    after its last retry failed."""
    policy = fresh()
    now, life, last_seen = 0.0, 0, ActorState.STARTING
    faults: dict[int, FaultSeen] = {}
    in_flight: tuple[SendRetry, int] | None = None
    for kind, a, b in events:
        if kind == "wait":
            now += a
        elif kind in ("observe", "restart"):
            life += kind == "restart"
            policy.observe(E0, a, now, incarnation=f"life-{life}", is_status=b)
            last_seen = a
        elif kind == "result" and in_flight is not None:
            retry, fault = in_flight
            policy.on_result(E0, retry.ticket, a, "", now)
            engine = policy.engines[E0]
            if not a and engine.in_fault and fault == engine.num_faults:
                faults[fault].last_failure_at = now
            in_flight = None
        for decision in policy.poll(now):
            fault = policy.engines[E0].num_faults
            seen = faults.setdefault(fault, FaultSeen())
            if isinstance(decision, GiveUp):
                seen.num_given_up += 1
                assert seen.num_given_up == 1 and seen.num_sent == LIMITS.max_retries
                assert in_flight is None
                continue
            assert in_flight is None, "two retries in flight"
            assert last_seen is UNHEALTHY
            assert decision.attempt == seen.num_sent + 1 <= LIMITS.max_retries
            if seen.last_failure_at is not None:
                assert now - seen.last_failure_at >= LIMITS.backoff(seen.num_sent) - 1e-9
            seen.num_sent += 1
            in_flight = decision, fault

"""The scheduler's liveness policy (``services/scheduler/liveness.py``), without NATS: every
verdict and its boundary, with the times injected (heartbeat_timeout_s 10, step_timeout_s 60)."""

from __future__ import annotations

import pytest

from services.scheduler.liveness import FailWaiting, Liveness, PingAnswer, Verdict
from shared.messages import ServiceError

HB, STEP = 10.0, 60.0


@pytest.fixture
def live() -> Liveness:
    policy = Liveness(heartbeat_timeout_s=HB, step_timeout_s=STEP)
    policy.group_registered("g", now=0.0)
    return policy


def idle(live: Liveness, now: float, last_step_id: int, oldest: int | None = 5) -> Verdict | None:
    return live.heartbeat("g", now, idle=True, last_step_id=last_step_id, stopping=False, oldest_step_id=oldest)


def busy(live: Liveness, now: float, oldest: int | None = 5) -> Verdict | None:
    return live.heartbeat("g", now, idle=False, last_step_id=5, stopping=False, oldest_step_id=oldest)


# ---------------------------------------------------------------------- heartbeat lost


def test_a_group_silent_for_more_than_heartbeat_timeout_s_is_lost(live):
    assert live.check("g", 10.0) is None  # exactly the timeout: not yet
    assert live.check("g", 10.5) is Verdict.HEARTBEAT_LOST
    assert busy(live, 10.5, oldest=None) is None  # a heartbeat: alive again
    assert live.check("g", 20.5) is None
    assert live.check("g", 20.75) is Verdict.HEARTBEAT_LOST


def test_a_result_counts_as_a_sign_of_life(live):
    live.step_sent("g", 1.0)
    live.result_received("g", 9.0)
    assert live.check("g", 19.0) is None
    assert live.check("g", 19.5) is Verdict.HEARTBEAT_LOST


def test_a_forgotten_group_gets_no_verdict(live):
    live.step_sent("g", 1.0)
    live.forget("g")
    assert live.check("g", 1000.0) is None and "g" not in live.groups
    live.group_registered("g", now=1000.0)  # registered again: watched afresh
    assert live.groups["g"].step_sent_at == [] and live.check("g", 1010.0) is None


# ---------------------------------------------------------------------- step timed out


def test_the_oldest_step_times_out_after_step_timeout_s(live):
    live.step_sent("g", 1.0)
    for t in range(5, 65, 5):  # heartbeats keep the group alive meanwhile
        assert busy(live, float(t)) is None
    assert live.check("g", 61.0) is None  # exactly step_timeout_s: not yet
    assert live.check("g", 61.5) is Verdict.STEP_TIMED_OUT


def test_a_queued_step_is_timed_from_the_answer_to_the_step_before_it(live):
    live.step_sent("g", 1.0)
    live.step_sent("g", 2.0)  # async scheduling: queued behind the first
    live.result_received("g", 30.0)
    assert live.groups["g"].step_sent_at == [30.0]
    for t in range(35, 95, 5):
        assert busy(live, float(t)) is None
    assert live.check("g", 90.0) is None
    assert live.check("g", 90.5) is Verdict.STEP_TIMED_OUT


def test_a_step_sent_after_the_answer_keeps_its_own_start(live):
    live.step_sent("g", 1.0)
    live.step_sent("g", 50.0)
    live.result_received("g", 20.0)  # the second started running at 50, not at 20
    assert live.groups["g"].step_sent_at == [50.0]
    live.result_received("g", 55.0)
    assert live.groups["g"].step_sent_at == [] and live.check("g", 64.0) is None


# ---------------------------------------------------------------------- plan lost


def test_two_idle_heartbeats_that_never_received_a_step_sent_before_both_mean_its_plan_was_lost(live):
    live.step_sent("g", 1.0)  # step 5
    assert idle(live, 2.0, last_step_id=4) is None  # the plan may still be on its way
    assert idle(live, 3.0, last_step_id=4) is Verdict.PLAN_LOST


def test_a_step_sent_at_or_after_the_first_idle_heartbeat_is_not_lost_yet(live):
    assert idle(live, 2.0, last_step_id=4, oldest=None) is None  # nothing in flight: does not count
    live.step_sent("g", 2.0)
    assert idle(live, 2.0, last_step_id=4) is None  # the first idle heartbeat, at the step's sending
    assert idle(live, 3.0, last_step_id=4) is None  # the step was not sent before the first (2.0)
    assert idle(live, 4.0, last_step_id=4) is Verdict.PLAN_LOST  # it was sent before 3.0


def test_a_busy_heartbeat_between_the_idle_ones_restarts_the_count(live):
    live.step_sent("g", 1.0)
    assert idle(live, 2.0, last_step_id=4) is None
    assert busy(live, 3.0) is None
    assert idle(live, 4.0, last_step_id=4) is None
    assert idle(live, 5.0, last_step_id=4) is Verdict.PLAN_LOST


def test_idle_heartbeats_with_nothing_in_flight_are_no_verdict(live):
    for t in (1.0, 2.0, 3.0, 30.0):
        assert idle(live, t, last_step_id=0, oldest=None) is None


# ---------------------------------------------------------------------- result lost


def test_a_result_missing_for_more_than_heartbeat_timeout_s_after_an_idle_heartbeat_is_lost(live):
    live.step_sent("g", 1.0)
    assert idle(live, 2.0, last_step_id=5) is None  # it received step 5 and is idle
    assert idle(live, 7.0, last_step_id=5) is None
    assert idle(live, 12.0, last_step_id=5) is None  # exactly heartbeat_timeout_s since 2.0
    assert idle(live, 12.5, last_step_id=5) is Verdict.RESULT_LOST


def test_the_result_wait_restarts_on_a_busy_heartbeat_or_a_newer_oldest_step(live):
    live.step_sent("g", 1.0)
    assert idle(live, 2.0, last_step_id=5) is None
    assert busy(live, 3.0) is None
    assert idle(live, 4.0, last_step_id=5) is None  # the wait starts again at 4.0
    assert idle(live, 14.0, last_step_id=6, oldest=6) is None  # another step now: starts at 14.0
    assert idle(live, 24.0, last_step_id=6, oldest=6) is None
    assert idle(live, 24.5, last_step_id=6, oldest=6) is Verdict.RESULT_LOST


# ---------------------------------------------------------------------- stopping


def test_a_stopping_heartbeat_drops_the_group_at_once(live):
    verdict = live.heartbeat("g", 1.0, idle=False, last_step_id=0, stopping=True, oldest_step_id=None)
    assert verdict is Verdict.GROUP_STOPPED
    assert live.groups["g"].last_heartbeat == 1.0


# ---------------------------------------------------------------------- no group came back


def test_the_waiting_requests_fail_when_no_group_came_back_in_heartbeat_timeout_s(live):
    cause = ServiceError(message="executor group lost", type="server_error", status=500)
    live.forget("g")
    live.group_dropped(100.0, cause, groups_left=0)
    live.group_dropped(105.0, ServiceError(message="later"), groups_left=0)  # the wait already runs
    assert live.fail_waiting(110.0, has_groups=False, has_waiting=True) is None  # exactly the timeout
    assert live.fail_waiting(110.5, has_groups=False, has_waiting=False) is None  # nobody waits
    assert live.fail_waiting(110.5, has_groups=True, has_waiting=True) is None
    assert live.fail_waiting(110.5, has_groups=False, has_waiting=True) == FailWaiting(
        ServiceError(message="no executor group is available (the last one: executor group lost)",
                     type="server_error", code="no_executor", status=503), cause)
    live.group_registered("g2", now=111.0)  # a registration ends the wait
    assert live.fail_waiting(200.0, has_groups=False, has_waiting=True) is None


def test_the_wait_for_a_restarting_group_can_be_longer_than_the_heartbeat_timeout():
    live = Liveness(heartbeat_timeout_s=10.0, step_timeout_s=STEP, executor_wait_timeout_s=60.0)
    live.group_dropped(100.0, ServiceError(message="executor group lost"), groups_left=0)
    assert live.fail_waiting(150.0, has_groups=False, has_waiting=True) is None
    assert live.fail_waiting(160.5, has_groups=False, has_waiting=True).error.code == "no_executor"


def test_a_group_dropped_while_others_remain_starts_no_wait(live):
    live.group_dropped(100.0, ServiceError(message="lost"), groups_left=1)
    assert live.groups_lost is None
    assert live.fail_waiting(1000.0, has_groups=False, has_waiting=True) is None


# ---------------------------------------------------------------------- peers


def test_a_gateway_nobody_serves_twice_in_a_row_is_gone(live):
    assert live.gateway_ping("gw", PingAnswer.NO_RESPONDERS) is False  # reconnecting after a blip?
    assert live.peers.misses(("gateway", "gw")) == 1
    assert live.gateway_ping("gw", PingAnswer.ERROR) is False  # slow or NATS away: no verdict, no reset
    assert live.gateway_ping("gw", PingAnswer.NO_RESPONDERS) is True
    assert live.peers.misses(("gateway", "gw")) == 0  # counted afresh from here


def test_an_answer_restarts_a_peers_count(live):
    assert live.detokenizer_ping(1, PingAnswer.NO_RESPONDERS) is False
    assert live.detokenizer_ping(1, PingAnswer.ANSWERED) is False
    assert live.detokenizer_ping(1, PingAnswer.NO_RESPONDERS) is False
    assert live.detokenizer_ping(0, PingAnswer.NO_RESPONDERS) is False  # another shard: its own count
    assert live.detokenizer_ping(1, PingAnswer.NO_RESPONDERS) is True
    assert live.gateway_ping("1", PingAnswer.NO_RESPONDERS) is False  # a gateway is not a shard


def test_peers_no_longer_holding_requests_are_forgotten(live):
    live.gateway_ping("gone", PingAnswer.NO_RESPONDERS)
    live.detokenizer_ping(3, PingAnswer.NO_RESPONDERS)
    live.gateway_ping("kept", PingAnswer.NO_RESPONDERS)
    live.watch_peers(["kept"], [0])
    assert live.peers.misses(("gateway", "gone")) == 0 and live.peers.misses(("detokenizer", "3")) == 0
    assert live.gateway_ping("gone", PingAnswer.NO_RESPONDERS) is False  # a first miss again
    assert live.gateway_ping("kept", PingAnswer.NO_RESPONDERS) is True


def test_each_verdict_carries_the_error_of_the_group_it_drops():
    assert {v: (v.error.message, v.error.status) for v in Verdict} == {
        Verdict.GROUP_STOPPED: ("executor group stopped", 503),
        Verdict.PLAN_LOST: ("executor step lost", 503),
        Verdict.RESULT_LOST: ("executor step lost", 503),
        Verdict.HEARTBEAT_LOST: ("executor group lost", 500),
        Verdict.STEP_TIMED_OUT: ("executor step timed out", 500),
    }
    assert all(v.error.type == "server_error" for v in Verdict)

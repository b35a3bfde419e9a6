"""`StepClock`: predicted step ends from step times seen, for late scheduling."""

from __future__ import annotations

import pytest

from jaxpaged.engine.step_clock import MARGIN_S, SHRINK, StepClock


def test_no_deadline_without_a_step_in_flight_or_a_time_for_its_bucket():
    clock = StepClock()
    assert clock.deadline() is None
    clock.dispatched(64, 0.0, 0.002)
    assert clock.deadline() is None  # no time for bucket 64 yet
    clock.seed({32: 0.020})
    assert clock.deadline() is None


def test_deadline_is_the_predicted_end_less_the_host_time_and_a_margin():
    clock = StepClock()
    clock.seed({64: 0.030})
    clock.dispatched(64, 0.0, 0.002)  # 2 ms to schedule and dispatch
    assert clock.deadline() == pytest.approx(0.002 + 0.030 - 0.002 - MARGIN_S)


def test_a_waited_step_after_a_waited_step_records_its_exact_time():
    """Ended when fetched (waited) and started when the one before ended: the prediction follows it down."""
    clock = StepClock()
    clock.seed({64: 0.030})
    clock.dispatched(64, 0.0, 0.001)
    clock.fetched(0.031, waited=True)  # ended at 0.031: 30 ms from its dispatch
    clock.dispatched(64, 0.028, 0.029)  # queued behind it: starts at 0.031
    clock.fetched(0.056, waited=True)  # 25 ms
    clock.dispatched(64, 0.060, 0.061)  # the device was idle: starts at its dispatch
    assert clock.deadline() == pytest.approx(0.061 + 0.025 - 0.001 - MARGIN_S)


def test_a_longer_step_does_not_raise_the_prediction():
    clock = StepClock()
    clock.dispatched(64, 0.0, 0.001)
    clock.fetched(0.031, waited=True)  # 30 ms
    clock.dispatched(64, 0.200, 0.201)
    clock.fetched(0.301, waited=True)  # 100 ms (a slow step): the shortest recent time stays
    clock.dispatched(64, 0.400, 0.401)
    assert clock.deadline() == pytest.approx(0.401 + 0.030 - 0.001 - MARGIN_S)


def test_a_step_whose_start_is_unknown_records_nothing():
    """The step before it was found done (it ended some time before its fetch) while this one was queued: this
    one started then, unknown; waiting for it gives its end only."""
    clock = StepClock()
    clock.seed({64: 0.030})
    clock.dispatched(64, 0.0, 0.001)
    clock.dispatched(64, 0.002, 0.003)
    clock.fetched(0.040, waited=False)  # step 1 ended by 0.040 (later than predicted: no record)
    clock.fetched(0.050, waited=True)  # step 2 ended at 0.050, started between 0.003 and 0.040
    clock.dispatched(64, 0.100, 0.101)
    assert clock.deadline() == pytest.approx(0.101 + 0.030 - 0.001 - MARGIN_S)


def test_a_step_done_before_its_predicted_end_shortens_the_prediction():
    """Found done before the predicted end: the device waited for the host, so the next step goes earlier."""
    clock = StepClock()
    clock.seed({64: 0.030})
    clock.dispatched(64, 0.0, 0.001)
    clock.fetched(0.029, waited=False)  # done 28 ms after its dispatch, before the predicted 31
    clock.dispatched(64, 0.100, 0.101)
    assert clock.deadline() == pytest.approx(0.101 + SHRINK * 0.030 - 0.001 - MARGIN_S)


def test_a_step_fetched_long_after_its_end_changes_nothing():
    """A step left in flight while the engine idled is found done much later: no evidence of a long prediction."""
    clock = StepClock()
    clock.seed({64: 0.030})
    clock.dispatched(64, 0.0, 0.001)
    clock.fetched(5.0, waited=False)
    clock.dispatched(64, 5.0, 5.001)
    assert clock.deadline() == pytest.approx(5.001 + 0.030 - 0.001 - MARGIN_S)


def test_steps_queued_behind_each_other_end_one_after_another():
    clock = StepClock()
    clock.seed({64: 0.030, 128: 0.050})
    clock.dispatched(64, 0.0, 0.001)
    clock.dispatched(128, 0.002, 0.003)
    assert clock.deadline() == pytest.approx(0.001 + 0.030 + 0.050 - 0.001 - MARGIN_S)


def test_a_bucket_seen_once_forgets_its_seeded_time():
    """Warm steps run without prompts (no attention work): a served step's own time replaces the seed."""
    clock = StepClock()
    clock.seed({64: 0.020})
    clock.dispatched(64, 0.0, 0.001)
    clock.fetched(0.031, waited=True)  # 30 ms served
    clock.dispatched(64, 0.100, 0.101)
    assert clock.deadline() == pytest.approx(0.101 + 0.030 - 0.001 - MARGIN_S)


def test_by_tokens_a_step_is_predicted_at_its_share_of_the_bucket():
    """Where a step costs its real tokens, a 40-token step of the 64 bucket is predicted at its interpolated
    share of the bucket's time, and its measured time counts for the full bucket divided by that share."""
    clock = StepClock()
    clock.seed({32: 0.020, 64: 0.040}, by_tokens=True)
    clock.dispatched(64, 0.0, 0.001, num_tokens=48)  # half way from 32 to 64: 30 of 40 ms
    assert clock.deadline() == pytest.approx(0.001 + 0.030 - 0.001 - MARGIN_S)
    clock.fetched(0.025, waited=True)  # took 24 ms: 80% of its prediction, recorded as a 32 ms full bucket
    clock.dispatched(64, 0.100, 0.101)  # count unknown: the full bucket's
    assert clock.deadline() == pytest.approx(0.101 + 0.032 - 0.001 - MARGIN_S)
    plain = StepClock()
    plain.seed({32: 0.020, 64: 0.040})
    plain.dispatched(64, 0.0, 0.001, num_tokens=48)  # a step that pays for its bucket
    assert plain.deadline() == pytest.approx(0.001 + 0.040 - 0.001 - MARGIN_S)

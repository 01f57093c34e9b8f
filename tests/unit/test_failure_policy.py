"""The failure policy: restart until the budget (per rolling window) is spent; a crash loop stops at once, unless it is
injected machine faults (an injected exception stands for a bug and is a crash loop: tests/ray/test_elastic.py)."""

from __future__ import annotations

from orchestrator.controller.policies import FailureDecision, FailurePolicy, FailureSummary

DIED = "The actor died unexpectedly before finishing this task."


def test_the_same_error_at_the_same_step_three_times_is_a_crash_loop():
    policy = FailurePolicy(max_restarts=10)
    history = [FailureSummary("rank_died", 3, 0, DIED, 0.0)] * 3
    decision = policy.decide(history)
    assert decision.action is FailureDecision.Action.FAIL and decision.reason.startswith("crash loop: rank 3")


def test_a_hang_at_the_same_step_is_a_crash_loop_however_long_each_waited():
    policy = FailurePolicy(max_restarts=10)
    hangs = [FailureSummary("hang", None, 25, f"no step for {quiet} s (limit 60.0 s)", 0.0)
             for quiet in (61.3, 60.2, 64.9)]
    assert policy.decide(hangs[:2]).action is FailureDecision.Action.RESTART
    assert policy.decide(hangs).reason.startswith("crash loop: rank None failed at step 25 3 times")
    other = FailureSummary("rank_error", 1, 25, "ValueError: shape 4 vs 8", 0.0)
    assert policy.decide([*hangs[:2], other]).action is FailureDecision.Action.RESTART


def test_injected_kills_at_the_same_step_spend_the_budget_instead():
    # A chaos experiment whose kills land faster than the job recovers kills the same rank at step 0
    # again and again: that is the experiment, not a bug in the job.
    policy = FailurePolicy(max_restarts=4)
    kill = FailureSummary("kill_rank", 3, 0, DIED, 0.0, injected_machine_fault=True)
    assert policy.decide([kill] * 3).action is FailureDecision.Action.RESTART
    decision = policy.decide([kill] * 5)
    assert decision.action is FailureDecision.Action.FAIL
    assert decision.reason == "4 restarts used, elastic.max_restarts=4"


def test_only_the_random_machine_kinds_are_exempt():
    from orchestrator.controller.blame import MACHINE_FAULTS

    assert {"kill_rank", "kill_node", "hang_rank"} == MACHINE_FAULTS


def _kills(*hours: float) -> list[FailureSummary]:
    """Injected kills of different ranks at different steps (never a crash loop), at these hours."""
    return [FailureSummary("kill_rank", i, 100 * i, DIED, h * 3600.0, injected_machine_fault=True)
            for i, h in enumerate(hours)]


def test_the_budget_counts_only_the_restarts_within_the_window():
    # A long job failing every 3 hours: 40 failures over 5 days, never more than 8 in a day.
    policy = FailurePolicy(max_restarts=10, window_s=86400.0)
    history = _kills(*[3.0 * i for i in range(40)])
    decision = policy.decide(history)
    assert decision.action is FailureDecision.Action.RESTART
    assert decision.reason == "restart 8 of 10 in the last 24 h"
    # The same 40 failures counted over the whole run had stopped it at the eleventh.
    whole = FailurePolicy(max_restarts=10).decide(history)
    assert whole.action is FailureDecision.Action.FAIL and whole.reason == "39 restarts used, elastic.max_restarts=10"


def test_a_burst_within_the_window_still_stops_the_job():
    policy = FailurePolicy(max_restarts=3, window_s=600.0)
    burst = _kills(0.0, 1.0, 1.05, 1.1, 1.15)  # one an hour before, then four within 10 minutes
    decision = policy.decide(burst)
    assert decision.action is FailureDecision.Action.FAIL
    assert decision.reason == ("3 restarts used in the last 10 min, elastic.max_restarts=3 per "
                               "elastic.restart_window_s=600")
    assert policy.decide(burst[:4]).action is FailureDecision.Action.RESTART  # the one an hour before has aged out


def test_the_window_is_a_spec_field_and_null_counts_the_whole_run():
    from orchestrator.spec.job_spec import load_spec

    spec = load_spec("examples/demo.yaml", ["elastic.restart_window_s=null"])
    assert FailurePolicy.for_spec(spec).window_s is None
    assert FailurePolicy.for_spec(load_spec("examples/demo.yaml", [])).window_s == 86400.0


def test_a_non_finite_gradient_at_the_same_step_is_a_crash_loop_whichever_rank_is_heard_first():
    # The norm is all-reduced: every rank raises at once, and the one blamed changes from try to try.
    from orchestrator.controller.errors import normalise

    policy = FailurePolicy(max_restarts=10)
    # As the controller records them: normalised, cut at 100 characters (where depends on the rank's digits).
    nan = [FailureSummary("rank_error", rank, 40, normalise(
        f"NonFiniteGradient: non-finite gradient norm at step 40 on rank {rank} (nan); the weights are poisoned, "
        "recover from the last committed checkpoint"), 0.0) for rank in (3, 12, 3)]
    assert policy.decide(nan[:2]).action is FailureDecision.Action.RESTART
    decision = policy.decide(nan)
    assert decision.action is FailureDecision.Action.FAIL
    assert decision.reason.startswith("crash loop: every rank failed at step 40 3 times in a row")
    assert "train.lr" in decision.reason
    # Any other error on different ranks is no loop: each rank's own.
    other = [FailureSummary("rank_error", rank, 40, "ValueError: bad shape", 0.0) for rank in (2, 0, 5)]
    assert policy.decide(other).action is FailureDecision.Action.RESTART

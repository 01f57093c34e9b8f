"""The failure policy: restart until the budget is spent; a crash loop stops at once, unless it is
injected machine faults (an injected exception stands for a bug and is a crash loop: tests/ray/test_elastic.py)."""

from __future__ import annotations

from orchestrator.controller.policies import FailureDecision, FailurePolicy, FailureSummary

DIED = "The actor died unexpectedly before finishing this task."


def test_the_same_error_at_the_same_step_three_times_is_a_crash_loop():
    policy = FailurePolicy(max_restarts=10)
    history = [FailureSummary("rank_died", 3, 0, DIED)] * 3
    decision = policy.decide(history)
    assert decision.action is FailureDecision.Action.FAIL and decision.reason.startswith("crash loop: rank 3")


def test_a_hang_at_the_same_step_is_a_crash_loop_however_long_each_waited():
    policy = FailurePolicy(max_restarts=10)
    hangs = [FailureSummary("hang", None, 25, f"no step for {quiet} s (limit 60.0 s)") for quiet in (61.3, 60.2, 64.9)]
    assert policy.decide(hangs[:2]).action is FailureDecision.Action.RESTART
    assert policy.decide(hangs).reason.startswith("crash loop: rank None failed at step 25 3 times")
    other = FailureSummary("rank_error", 1, 25, "ValueError: shape 4 vs 8")
    assert policy.decide([*hangs[:2], other]).action is FailureDecision.Action.RESTART


def test_injected_kills_at_the_same_step_spend_the_budget_instead():
    # A chaos experiment whose kills land faster than the job recovers kills the same rank at step 0
    # again and again: that is the experiment, not a bug in the job.
    policy = FailurePolicy(max_restarts=4)
    kill = FailureSummary("kill_rank", 3, 0, DIED, injected_machine_fault=True)
    assert policy.decide([kill] * 3).action is FailureDecision.Action.RESTART
    decision = policy.decide([kill] * 5)
    assert decision.action is FailureDecision.Action.FAIL
    assert decision.reason == "4 restarts used, elastic.max_restarts=4"


def test_only_the_random_machine_kinds_are_exempt():
    from orchestrator.controller.blame import MACHINE_FAULTS

    assert {"kill_rank", "kill_node", "hang_rank"} == MACHINE_FAULTS

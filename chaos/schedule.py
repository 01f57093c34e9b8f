"""Fault schedules: the `chaos:` section expanded into a list of fault events, reproducibly.

Two sources of faults:
* explicit: each `chaos.faults[i]` (a `FaultSpec`: kind, rank or node, at_step, at_seconds
  or at_point) becomes one event with id `i`, the id the controller already gives it;
* random: with `chaos.mtbf_s` set, every target (each node for `mtbf_kind: kill_node`,
  each rank otherwise) fails as an independent Poisson process with mean time between
  failures `mtbf_s`, from `mtbf_start_s` until the horizon. Superposed, the job sees a
  failure every `mtbf_s / targets` seconds on average (docs/design.md section 1: M_node / N).

Protocol: the controller calls `expand(chaos, horizon_s=..., nodes=..., ranks=...)` when it
knows the job's nodes and ranks, and again after a re-placement if they changed (the same
arguments always give the same events: nothing here reads a clock or a global random
state). It fires time-triggered events when the job clock passes `at_seconds`
(`due_by_time`), and arms step/point-triggered ones in the rank injector through
`event.fault`, an ArmedFault (FaultSpec fields and the event id) as the injectors take it.

Each target draws from its own generator, seeded from (seed, target), so adding a node
does not move the failures of the others, and a run replays exactly from its seed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from chaos.config import RANK_KINDS, ArmedFault, ChaosConfig, FaultSpec


@dataclass(frozen=True)
class FaultEvent:
    """One fault to fire. Exactly the trigger fields of its FaultSpec are set."""

    id: int  # explicit: the index in chaos.faults; random: numbered after them, in time order
    kind: str
    source: Literal["explicit", "random"]
    at_seconds: float | None = None  # job seconds
    at_step: int | None = None
    at_point: str | None = None
    rank: int | None = None
    node: str | None = None
    fault: ArmedFault | None = field(default=None, compare=False)  # the fault itself, for the injector


def poisson_times(mtbf_s: float, horizon_s: float, *, seed: int, target: str, start_s: float = 0.0,
                  limit: int | None = None) -> list[float]:
    """Failure times of one target in [start_s, horizon_s): exponential gaps with mean `mtbf_s`; the
    first `limit` of them when given (the same first ones: a limit only stops the draws).

    A pure function of its arguments: the generator is seeded with a string built from
    (seed, target), which `random.Random` turns into its state through SHA-512, so the
    draws are the same in every process (PYTHONHASHSEED plays no part).
    """
    if not mtbf_s > 0.0 or not math.isfinite(mtbf_s):
        raise ValueError(f"mtbf_s must be a positive number of seconds, got {mtbf_s!r}")
    rng = random.Random(f"undying.chaos:{seed}:{target}")
    times, t = [], float(start_s)
    while limit is None or len(times) < limit:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= horizon_s:
            break
        times.append(t)
    return times


def random_faults(
    chaos: ChaosConfig, *, horizon_s: float, nodes: Sequence[str] = (), ranks: int = 0
) -> list[FaultSpec]:
    """The random failures of `chaos` up to `horizon_s` job seconds, in time order (empty without mtbf_s).

    `nodes`: the job's node ids (kill_node targets), in a stable order (FaultClock.schedule: by the
    lowest rank each hosts): a node's failures are drawn for its place in that order, not its id,
    which Ray draws anew on every cluster and every raylet restart, so a seed replays on another
    cluster. `ranks`: the number of ranks (targets of the rank kinds). Ties in time are broken
    by target so the order is total.
    """
    if chaos.mtbf_s is None:
        return []
    if chaos.mtbf_kind in RANK_KINDS:
        if ranks <= 0:
            raise ValueError(f"chaos.mtbf_kind={chaos.mtbf_kind} picks ranks; pass ranks=<world size> (got {ranks})")
        targets: list[tuple[str, dict]] = [(f"rank{r}", {"rank": r}) for r in range(ranks)]
    else:
        if not nodes:
            raise ValueError("chaos.mtbf_kind=kill_node picks nodes; pass nodes=<the job's node ids>")
        targets = [(f"node{i}", {"node": n}) for i, n in enumerate(dict.fromkeys(nodes))]
    draws = []
    for label, target in targets:
        # The job's first mtbf_max_faults failures take at most that many of any one target's.
        for t in poisson_times(chaos.mtbf_s, horizon_s, seed=chaos.seed, target=label, start_s=chaos.mtbf_start_s,
                               limit=chaos.mtbf_max_faults):
            draws.append((t, label, target))
    draws.sort(key=lambda d: (d[0], d[1]))
    if chaos.mtbf_max_faults is not None:
        draws = draws[: chaos.mtbf_max_faults]
    return [FaultSpec(kind=chaos.mtbf_kind, at_seconds=t, **target) for t, _, target in draws]


def expand(chaos: ChaosConfig, *, horizon_s: float, nodes: Sequence[str] = (), ranks: int = 0) -> list[FaultEvent]:
    """Every fault of `chaos` as an event: explicit ones (all of them) and random ones before `horizon_s`.

    Ordered by time (`at_seconds`), then by step, then by id; events with only `at_point`
    come last. The ids of explicit faults are their indices in `chaos.faults`.
    """
    specs = [("explicit", f) for f in chaos.faults]
    specs += [("random", f) for f in random_faults(chaos, horizon_s=horizon_s, nodes=nodes, ranks=ranks)]
    events = [_event(i, source, spec) for i, (source, spec) in enumerate(specs)]
    return sorted(events, key=_order)


def due_by_time(events: Iterable[FaultEvent], now_s: float, fired: Iterable[int] = ()) -> list[FaultEvent]:
    """Time-triggered events whose time has come (`at_seconds <= now_s`) and whose id is not in `fired`."""
    done = set(fired)
    return [e for e in events if e.at_seconds is not None and e.at_seconds <= now_s and e.id not in done]


def _event(event_id: int, source: Literal["explicit", "random"], spec: FaultSpec) -> FaultEvent:
    return FaultEvent(
        id=event_id, kind=spec.kind, source=source, at_seconds=spec.at_seconds, at_step=spec.at_step,
        at_point=spec.at_point, rank=spec.rank, node=spec.node, fault=ArmedFault.of(spec, event_id),
    )


def _order(event: FaultEvent) -> tuple[float, float, int]:
    return (
        event.at_seconds if event.at_seconds is not None else math.inf,
        event.at_step if event.at_step is not None else math.inf,
        event.id,
    )

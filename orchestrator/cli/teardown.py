"""How a driver ends (`undying run`, collective or parameter-server): its signal handlers and its teardown.

Protocol: once Ray is connected the driver routes the signals to a `StartUpSignals`'
`on_signal` (`route_signals`), keeps the returned `restore` until its teardown is over, and
catches `StoppedBeforeStart` around its set-up: a signal there ends the job at once, PREEMPTED
(exit 75, retry it), as any signalled job does; its `finally` calls `end()` first, so that a
signal during the teardown (after a set-up that returned early) is only recorded. Once the part
that acts on signals exists (its controller or supervisor; its handler only records them) it
routes them there, discarding that call's `restore` (which would put the start-up handler back),
and calls `teardown([...])` in its `finally`. A signal during the report or the teardown is then
recorded, never raised as an exception that would cut either short.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable


class StoppedBeforeStart(BaseException):
    """SIGTERM or SIGINT while the driver set the job up (a wait for the checkpoint root's owner
    lease, the actors' start): nothing trained and no checkpoint written. A BaseException, as
    KeyboardInterrupt is, so that no handler that turns a failure into a fallback takes it for one."""


class StartUpSignals:
    """The driver's signal handler from Ray's connection until its controller or supervisor takes
    the signals over: the first signal raises StoppedBeforeStart wherever the set-up is (there is
    nothing to checkpoint; waiting for the set-up to end could outlast a pod's grace), a later one
    (the teardown under way) is only recorded, so that the teardown runs whole."""

    def __init__(self):
        self.signals: list[str] = []
        self.ending = False  # the driver's teardown: signals are recorded only (`end`)

    def end(self) -> None:
        """The driver tears down (its set-up returned, or failed): a signal must not cut that short."""
        self.ending = True

    def on_signal(self, signum: int, _frame=None) -> None:
        self.signals.append(signal.Signals(signum).name)
        if len(self.signals) == 1 and not self.ending:
            raise StoppedBeforeStart(f"{self.signals[0]} while the job was set up, before it trained: nothing "
                                     "was checkpointed; rerun the job")


def route_signals(handler) -> Callable[[], None]:
    """Route SIGTERM and SIGINT to `handler(signum, frame)`; returns what puts the previous handlers
    (Ray's driver handler exits at once) back. Only the main thread can install handlers: from
    another thread this changes nothing."""
    signals = (signal.SIGTERM, signal.SIGINT) if threading.current_thread() is threading.main_thread() else ()
    previous = {s: signal.signal(s, handler) for s in signals}

    def restore() -> None:
        for s, old in previous.items():
            signal.signal(s, old)

    return restore


def teardown(steps: list[Callable[[], None] | None]) -> None:
    """Run `steps` in order (None: nothing to do there), each whatever the one before raised (printed),
    so none is skipped. `undying run` passes the rank actors, the trackers (the event log is the
    root's, so its last write comes first), the checkpoint root's lease (the next run of the job waits
    for it), the metrics endpoint and Ray."""
    interrupted: BaseException | None = None
    for step in steps:
        if step is None:
            continue
        try:
            step()
        except Exception as err:
            print(f"undying: teardown: {getattr(step, '__qualname__', step)} failed ({type(err).__name__}: {err})",
                  file=sys.stderr, flush=True)
        except BaseException as err:  # a signal before they were routed (SystemExit, KeyboardInterrupt)
            interrupted = interrupted or err  # raised once every step ran: the lease is still released
    if interrupted is not None:
        raise interrupted

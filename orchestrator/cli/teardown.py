"""How a driver ends (`undying run`, collective or parameter-server): its signal handlers and its teardown.

Protocol: the driver calls `route_signals(handler)` once the part that acts on signals exists
(its controller or supervisor; the handler only records them), keeps the returned `restore`
until its teardown is over, and calls `teardown([...])` in its `finally`. A signal during the
report or the teardown is then recorded, never raised as an exception that would cut either short.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable


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

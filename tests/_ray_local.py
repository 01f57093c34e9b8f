"""A private embedded Ray inside the test process, for tests that start actors themselves
(parameter-server jobs): `with embedded_ray(num_cpus): ...`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def embedded_ray(num_cpus: int) -> Iterator[None]:
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"  # a private cluster inside this process: no token to distribute
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level="ERROR")
    try:
        yield
    finally:
        ray.shutdown()

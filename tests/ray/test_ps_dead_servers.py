"""`paramserver.streams.dead_servers` against a real cluster: after a segment stops, the servers
that died or hang are found, all asked at once, within one timeout however many hang."""

from __future__ import annotations

import time

import pytest

from paramserver.streams import dead_servers

pytestmark = pytest.mark.ray


def test_dead_and_hung_servers_are_found_within_one_timeout(ray_cluster):
    import ray

    ray.init(address=ray_cluster, logging_level="ERROR")
    try:
        @ray.remote(num_cpus=0, max_restarts=0, max_concurrency=2)
        class Server:
            def __init__(self, hangs: bool):
                self.hangs = hangs

            def progress(self) -> int:
                if self.hangs:
                    time.sleep(600)
                return 7

        servers = [Server.remote(hangs) for hangs in (False, True, False, True, False)]
        ray.get(servers[0].progress.remote())
        ray.kill(servers[2])  # died
        started = time.monotonic()
        assert dead_servers(servers, timeout_s=3.0) == {1, 2, 3}
        assert time.monotonic() - started < 5.5  # one 3 s wait for both hung servers, not one each
        assert dead_servers([], timeout_s=3.0) == set()
    finally:
        ray.shutdown()

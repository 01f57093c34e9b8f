"""The Ray address a driver joins, checked before Ray is asked: one line naming where the address
came from and the fix, at once, instead of a traceback or minutes of GCS retries."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from orchestrator.cli.main import main
from orchestrator.cluster.address import RayAddressError, check_address

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def listening():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield f"127.0.0.1:{server.getsockname()[1]}"


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_host_port_that_answers_and_auto_pass(listening):
    check_address(listening, "--address")
    check_address("auto", "RAY_ADDRESS")  # Ray itself finds this node's cluster (ray_cluster.connect)
    check_address("local", "--address")  # a new local cluster, as ray.init means it


@pytest.mark.parametrize("address, words", [
    ("garbage", "not host:port"),
    ("127.0.0.1:99999", "not host:port"),
    ("http://127.0.0.1:8265", "a dashboard URL, for `ray job submit`"),
    ("ray://127.0.0.1:10001", "runs on a node of the cluster"),
])
def test_addresses_that_cannot_reach_a_cluster_say_why_and_the_fix(address, words):
    with pytest.raises(RayAddressError, match="--address") as err:
        check_address(address, "--address")
    assert words in str(err.value) and "host:6379" in str(err.value)


def test_nothing_listening_is_refused_at_once():
    with pytest.raises(RayAddressError, match="nothing answers there.*is the cluster up"):
        check_address(f"127.0.0.1:{_closed_port()}", "RAY_ADDRESS")


def test_undying_run_with_a_bad_address_exits_2_with_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code = main(["run", str(ROOT / "examples/demo.yaml"), "--address", f"127.0.0.1:{_closed_port()}",
                 "--set", f"checkpoint.url=file://{tmp_path}/ckpt"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("undying run: --address '127.0.0.1:")

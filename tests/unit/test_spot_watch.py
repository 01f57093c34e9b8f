"""`undying spot-watch` against fake EC2 and GCE metadata services on 127.0.0.1 (real HTTP, the
requests the clouds document): no drain while nothing is announced, a drain by the announced
time less the margin once it is, the IMDSv2 token on every read, and one clear line when there is
no metadata service. The drain itself is drain-node's (tests/ray/test_drain_node_cmd.py)."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time

import pytest

import orchestrator.cli.spot_watch as spot_watch
from orchestrator.cli.main import main


class FakeMetadata(http.server.BaseHTTPRequestHandler):
    """EC2's IMDSv2 (a token, then spot/instance-action: 404 until announced) and GCE's
    instance/preempted, announcing after `quiet_polls` reads."""

    quiet_polls = 2
    announced_at = "2030-01-01T00:02:00Z"
    reads: list[str] = []

    def log_message(self, *args):  # keep the test's output quiet
        pass

    def _send(self, code: int, body: str) -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self):
        ok = self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        self._send(200 if ok else 400, "token-1" if ok else "")

    def do_GET(self):
        type(self).reads.append(self.path)
        announced = len(type(self).reads) > type(self).quiet_polls
        if self.path == "/latest/meta-data/spot/instance-action":
            if self.headers.get("X-aws-ec2-metadata-token") != "token-1":
                return self._send(401, "")
            if not announced:
                return self._send(404, "")
            return self._send(200, json.dumps({"action": "terminate", "time": type(self).announced_at}))
        if self.path == "/computeMetadata/v1/instance/preempted" and self.headers.get("Metadata-Flavor") == "Google":
            return self._send(200, "TRUE" if announced else "FALSE")
        return self._send(404, "")


@contextlib.contextmanager
def metadata_service():
    FakeMetadata.reads = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeMetadata)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def drains(monkeypatch):
    calls = []

    def drain_until(address, node_id, reason, deadline):
        calls.append((address, node_id, reason, deadline))
        return 0

    import orchestrator.cli.drain_node as drain_node

    monkeypatch.setattr(drain_node, "drain_until", drain_until)
    return calls


def test_an_ec2_spot_notice_drains_this_node_by_its_time_less_the_margin(drains, capsys):
    with metadata_service() as url:
        code = main(["spot-watch", "--cloud", "aws", "--metadata", url, "--poll", "0.05", "--margin", "7"])
    assert code == 0 and FakeMetadata.reads == ["/latest/meta-data/spot/instance-action"] * 3
    [(address, node, reason, deadline)] = drains
    assert address == "auto" and node is None and reason == "spot preemption notice"
    assert deadline == 1893456120.0 - 7  # 2030-01-01T00:02:00Z, epoch seconds, less the margin
    assert "preemption announced for 00:02:00 UTC" in capsys.readouterr().out


def test_a_gce_preemption_drains_within_its_30_s_notice(drains):
    with metadata_service() as url:
        before = time.time()
        assert main(["spot-watch", "--cloud", "gcp", "--metadata", url, "--poll", "0.05"]) == 0
    [(_, _, _, deadline)] = drains
    assert before + 30 - 5 <= deadline <= time.time() + 30 - 5


def test_a_notice_already_past_still_drains_with_a_moment_to_go(drains, monkeypatch):
    monkeypatch.setattr(FakeMetadata, "quiet_polls", 0)
    monkeypatch.setattr(FakeMetadata, "announced_at", "2020-01-01T00:00:00Z")
    with metadata_service() as url:
        assert main(["spot-watch", "--metadata", url, "--poll", "0.05"]) == 0
    [(_, _, _, deadline)] = drains
    assert deadline > time.time()


def test_no_metadata_service_is_one_line_naming_the_flags(drains, capsys):
    with metadata_service() as url:
        pass  # closed: nothing listens there any more
    assert main(["spot-watch", "--cloud", "aws", "--metadata", url]) == 2
    err = capsys.readouterr().err
    assert f"no aws instance metadata at {url}" in err and "--cloud and --metadata" in err and not drains


@pytest.mark.parametrize("flag, value", [("--poll", "0"), ("--margin", "-1"), ("--poll", "inf"), ("--poll", "nan")])
def test_a_poll_or_margin_that_is_not_a_sane_number_of_seconds_is_refused(flag, value, capsys):
    assert main(["spot-watch", flag, value]) == 2
    assert f"{flag} must be a number of seconds above 0 and up to 600" in capsys.readouterr().err


def test_a_malformed_notice_is_an_error_not_a_drain(monkeypatch):
    monkeypatch.setattr(FakeMetadata, "quiet_polls", 0)
    monkeypatch.setattr(FakeMetadata, "announced_at", None)
    with metadata_service() as url, pytest.raises(ValueError, match="without a time"):
        spot_watch.aws_notice(url)


def test_a_poll_that_fails_midway_is_said_once_and_retried(capsys):
    answers = iter([OSError("timed out"), OSError("timed out"), None, 1234.0])

    def check(base):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert spot_watch._watch(check, "http://x", 0.01, None) == 1234.0
    assert capsys.readouterr().err.count("a poll failed (OSError: timed out); retrying") == 1

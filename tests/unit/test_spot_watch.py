"""`undying spot-watch` against fake EC2 and GCE metadata services on 127.0.0.1 (real HTTP, the
requests the clouds document): no drain while nothing is announced, a drain by the announced
time less the margin once it is (by the time itself when the margin no longer fits, none once it
has passed), a notice without a time dated from the last quiet poll, the IMDSv2 token on every
read, and one clear line when there is no metadata service. The drain itself is drain-node's
(tests/ray/test_drain_node_cmd.py)."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import threading
import time

import pytest

import orchestrator.cli.spot_watch as spot_watch
from orchestrator.cli.main import main


def utc(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


class FakeMetadata(http.server.BaseHTTPRequestHandler):
    """EC2's IMDSv2 (a token, then spot/instance-action: 404 until announced) and GCE's
    instance/preempted, announcing after `quiet_polls` reads."""

    quiet_polls = 2
    announced_at = None  # set by each test (EC2's format, UTC)
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


def test_an_ec2_spot_notice_drains_this_node_by_its_time_less_the_margin(drains, capsys, monkeypatch):
    announced = float(int(time.time()) + 120)
    monkeypatch.setattr(FakeMetadata, "announced_at", utc(announced))
    with metadata_service() as url:
        code = main(["spot-watch", "--cloud", "aws", "--metadata", url, "--poll", "0.05", "--margin", "7"])
    assert code == 0 and FakeMetadata.reads == ["/latest/meta-data/spot/instance-action"] * 3
    [(address, node, reason, deadline)] = drains
    assert address == "auto" and node is None and reason == "spot preemption notice"
    assert deadline == announced - 7
    assert f"preemption announced for {utc(announced)[11:19]} UTC" in capsys.readouterr().out


def test_a_gce_preemption_is_dated_from_the_last_poll_that_saw_none(drains):
    with metadata_service() as url:
        before = time.time()
        assert main(["spot-watch", "--cloud", "gcp", "--metadata", url, "--poll", "0.05"]) == 0
        after = time.time()
    [(_, _, _, deadline)] = drains
    assert before + 30 - 5 <= deadline <= after - 0.05 + 30 - 5  # the last FALSE came a poll before the TRUE


def test_a_notice_too_near_for_the_margin_drains_by_its_time_and_one_past_drains_nothing(drains, monkeypatch,
                                                                                          capsys):
    monkeypatch.setattr(FakeMetadata, "quiet_polls", 0)
    near = float(int(time.time()) + 8)  # 8 s left: a 5 s margin would leave 3 s for the drain
    monkeypatch.setattr(FakeMetadata, "announced_at", utc(near))
    with metadata_service() as url:
        assert main(["spot-watch", "--metadata", url]) == 0
    assert [deadline for *_, deadline in drains] == [near]
    monkeypatch.setattr(FakeMetadata, "announced_at", utc(time.time() - 30))
    with metadata_service() as url:
        assert main(["spot-watch", "--metadata", url]) == 1
    assert len(drains) == 1 and "too late to drain" in capsys.readouterr().err


def test_an_ec2_notice_whose_time_does_not_parse_is_still_a_notice(drains, monkeypatch, capsys):
    monkeypatch.setattr(FakeMetadata, "announced_at", "soon")
    with metadata_service() as url:
        before = time.time()
        assert main(["spot-watch", "--metadata", url, "--poll", "0.05"]) == 0
    [(_, _, _, deadline)] = drains
    assert before + 120 - 5 <= deadline <= time.time() + 120 - 5
    assert "an interruption notice whose time does not parse" in capsys.readouterr().err


def test_no_metadata_service_is_one_line_naming_the_flags(drains, capsys):
    with metadata_service() as url:
        pass  # closed: nothing listens there any more
    assert main(["spot-watch", "--cloud", "aws", "--metadata", url]) == 2
    err = capsys.readouterr().err
    assert f"no aws instance metadata at {url}" in err and "--cloud and --metadata" in err and not drains


@pytest.mark.parametrize("cloud, flag, value, most", [
    ("aws", "--poll", "0", "up to 30"), ("aws", "--margin", "-1", "below 60"), ("aws", "--poll", "inf", "up to 30"),
    ("aws", "--poll", "nan", "up to 30"), ("gcp", "--poll", "10", "up to 7.5"), ("gcp", "--margin", "15", "below 15")])
def test_a_poll_or_margin_that_the_clouds_notice_cannot_hold_is_refused(cloud, flag, value, most, capsys):
    assert main(["spot-watch", "--cloud", cloud, flag, value]) == 2
    assert f"{flag} must be a number of seconds above 0 and {most} on {cloud}" in capsys.readouterr().err


def test_a_poll_that_fails_midway_is_said_once_and_retried(capsys):
    answers = iter([OSError("timed out"), http.client.IncompleteRead(b""), None, 1234.0])

    def check(base):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert spot_watch._watch(check, "http://x", 0.01, None, 0.0, 120.0) == 1234.0
    err = capsys.readouterr().err
    assert err.count("a poll failed") == 1 and "(OSError: timed out); retrying" in err

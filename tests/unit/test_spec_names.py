"""The job's name: one safe directory under checkpoint.url, and none a checkpoint root uses itself."""

from __future__ import annotations

import pytest
import yaml

from ckpt.owner_claims import OWNER_DIR
from monitor.event_log import EVENTS_DIR
from orchestrator.cli.root_lease import CHAOS_MARKER
from orchestrator.controller.kill import MARKER_DIR
from orchestrator.controller.ledger_snapshot import SNAPSHOT_FILE
from orchestrator.spec.job_spec import ROOT_ENTRIES, validate_spec
from tests.unit.test_spec import TINY_YAML, fields_of


@pytest.fixture
def tiny_data() -> dict:
    return yaml.safe_load(TINY_YAML)


@pytest.mark.parametrize("name", ["my job", "..", ".", "a/b", ""])
def test_name_must_be_a_safe_path_component(tiny_data, name):
    assert fields_of({**tiny_data, "name": name}) == ["name"]


def test_a_name_a_checkpoint_root_uses_for_its_own_entries_is_refused(tiny_data):
    """A job whose checkpoint.url is another job's root must not look like that job's step directory
    (its retention would delete it as an unfinished save) or its lease, events or markers."""
    assert set(ROOT_ENTRIES) == {OWNER_DIR, EVENTS_DIR, SNAPSHOT_FILE, MARKER_DIR, CHAOS_MARKER}
    for name in [*ROOT_ENTRIES, "step-000000100"]:
        assert fields_of({**tiny_data, "name": name}) == ["name"], name
    validate_spec({**tiny_data, "name": "step-100"})  # not a step directory's name: taken

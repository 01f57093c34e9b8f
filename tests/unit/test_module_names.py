"""Test modules outside a package are imported by their basename (pytest's default import mode), so two
of them with one name stop the whole collection: keep the names apart."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_top_level_test_modules_share_a_name():
    rootless = [d for d in TESTS.iterdir() if d.is_dir() and not (d / "__init__.py").exists()]
    names = Counter(p.name for d in rootless for p in d.glob("test_*.py"))
    assert not [name for name, count in names.items() if count > 1], names.most_common(3)

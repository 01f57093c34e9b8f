"""Shared Hypothesis settings and strategies for the fuzz tests (tests/unit/test_fuzz_*.py).

Deterministic (derandomize, no example database): the default suite draws the same examples
on every machine, so a failure reproduces from the test's name alone. Bounded: each test sets
its `max_examples`, all of them together stay well under a minute, and a per-example deadline
turns a runaway example into a failure instead of a stuck suite.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st


def fuzz(max_examples: int) -> settings:
    return settings(max_examples=max_examples, deadline=timedelta(seconds=5), derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], print_blob=False)


# JSON values, as a parser of untrusted text can meet them.
json_scalars = st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) \
    | st.floats(allow_nan=False) | st.text(max_size=12)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a node of a JSON-like tree (the root is `()`)."""
    out = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            out += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += _paths(item, (*prefix, i))
    return out


@st.composite
def mutated(draw, document: Any, values=json_values) -> Any:
    """`document` (a JSON-like tree, unchanged) with one to three nodes replaced, deleted or added."""
    doc = json.loads(json.dumps(document))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(doc)))
        if not path:
            return draw(values)
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(values)
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(values)
        else:
            parent.append(draw(values))
    return doc


@st.composite
def mutated_bytes(draw, data: bytes) -> bytes:
    """`data` truncated, or with a few bytes overwritten or inserted."""
    out = bytearray(data)
    if draw(st.booleans()):
        return bytes(out[:draw(st.integers(0, len(out)))])
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, max(len(out) - 1, 0)))
        byte = draw(st.integers(0, 255))
        if draw(st.booleans()) and out:
            out[at] = byte
        else:
            out.insert(at, byte)
    return bytes(out)

"""Tool-call arguments between JSON text and mapping: the one helper every module uses."""

from __future__ import annotations

import pytest

from hcapo_store.tool_arguments import arguments_text, as_mapping


@pytest.mark.parametrize(
    "value,expected",
    [
        ('{"command": "ls"}', '{"command": "ls"}'),  # text stays exactly as it is
        ("not json", "not json"),
        (None, "{}"),
        ({"path": "é"}, '{"path": "é"}'),  # non-ASCII kept as UTF-8, as stored since the first release
        ({}, "{}"),
    ],
)
def test_arguments_text(value, expected):
    assert arguments_text(value) == expected


@pytest.mark.parametrize(
    "value,expected",
    [
        ({"a": 1}, {"a": 1}),
        ('{"a": 1}', {"a": 1}),
        ("[1, 2]", None),  # JSON, but not an object
        ("plain text", None),
        ("9" * 5000, None),  # an integer json refuses to read
        ("[" * 100_000 + "]" * 100_000, None),  # nested too deeply
        (5, None),
        (None, None),
    ],
)
def test_as_mapping(value, expected):
    assert as_mapping(value) == expected


def test_round_trip():
    args = {"tool": "openenv_submit_plan", "args": {"subtasks": [{"id": "S1"}]}}
    assert as_mapping(arguments_text(args)) == args

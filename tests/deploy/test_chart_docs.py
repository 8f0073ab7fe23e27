"""The chart's README documents every value, and the schema knows every value.

A value is a leaf of values.yaml: anything but an object whose keys the
schema lists (those are walked into). Free-form objects such as `resources`
or `affinity` are leaves, documented with their default.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .conftest import CHART_DIR, load_yaml

ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*([^|]+?)\s*\|\s*`(.*)`\s*\|\s*(.+?)\s*\|\s*$")


def _schema() -> dict[str, Any]:
    return json.loads((CHART_DIR / "values.schema.json").read_text())


def _leaves(values: dict[str, Any], schema: dict[str, Any], prefix: str = ""):
    for key, value in values.items():
        node = schema.get("properties", {}).get(key)
        assert node is not None, f"{prefix}{key} is in values.yaml but not in values.schema.json"
        if isinstance(value, dict) and "properties" in node:
            yield from _leaves(value, node, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value, node


def _readme_rows() -> dict[str, tuple[str, str, str]]:
    rows: dict[str, tuple[str, str, str]] = {}
    for line in (CHART_DIR / "README.md").read_text().splitlines():
        match = ROW.match(line)
        if match:
            key, type_, default, description = match.groups()
            assert key not in rows, f"{key} is listed twice in README.md"
            rows[key] = (type_, default, description)
    return rows


def test_every_value_is_in_the_readme_table() -> None:
    values = load_yaml(CHART_DIR / "values.yaml")
    leaves = {key: (value, node) for key, value, node in _leaves(values, _schema())}
    rows = _readme_rows()
    missing = sorted(set(leaves) - set(rows))
    assert not missing, f"values missing from README.md's table: {missing}"
    stale = sorted(set(rows) - set(leaves))
    assert not stale, f"README.md documents values that do not exist: {stale}"
    for key, (value, _) in leaves.items():
        _, default, description = rows[key]
        assert json.loads(default) == value, f"{key}: README default {default} != {value!r}"
        assert description.strip(), f"{key} has no description"


def test_schema_refuses_unknown_keys_in_every_chart_object() -> None:
    def walk(node: dict[str, Any], path: str) -> None:
        if "properties" in node:
            assert node.get("additionalProperties") is False, f"{path or '<root>'} accepts any key"
            for key, child in node["properties"].items():
                walk(child, f"{path}.{key}" if path else key)

    walk(_schema(), "")


def test_every_schema_leaf_has_a_description() -> None:
    values = load_yaml(CHART_DIR / "values.yaml")
    undocumented = [
        key for key, _, node in _leaves(values, _schema()) if not node.get("description")
    ]
    assert not undocumented

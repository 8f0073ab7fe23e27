"""The knobs are declared once: the README's table and the chart's engine values,
schema, rows and template are what the declarations generate."""

from __future__ import annotations

import dataclasses

from iterserve.cluster import config_docs
from iterserve.cluster.config import EngineConfig
from iterserve.scheduler.config import SchedulerConfig


def test_no_generated_file_has_drifted_from_the_declarations():
    drifted = [str(p.relative_to(config_docs.ROOT)) for p in config_docs.stale()]
    assert not drifted, f"run python -m iterserve.cluster.config_docs --write: {drifted}"


def test_every_config_field_is_documented_once_in_the_readme_table():
    names = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "scheduler"]
    names += [f.name for f in dataclasses.fields(SchedulerConfig)]
    table = config_docs.readme_table()
    for name in names:
        assert [row.split(" | ")[0] for row in table.splitlines()].count(f"| `{name}`") == 1, name


def test_the_chart_default_is_the_declarations_default_unless_it_says_otherwise():
    by_name = {k.helm_name: k for k in config_docs.knobs()}
    assert by_name["maxNumSeqs"].helm_default == SchedulerConfig().max_num_seqs
    assert by_name["kvMemoryFraction"].helm_default == 0.8  # a GPU cluster's
    assert EngineConfig().kv_memory_fraction == 0.3
    assert by_name["maxModelLen"].helm_default == 0  # unset: derived at start


def test_a_changed_declaration_shows_as_drift(monkeypatch):
    original = config_docs.knobs

    def renamed():
        knobs = original()
        first = knobs[0]
        return [dataclasses.replace(first, meta={**first.meta, "doc": "changed"}), *knobs[1:]]

    monkeypatch.setattr(config_docs, "knobs", renamed)
    assert config_docs.stale()

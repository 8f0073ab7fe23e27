"""The stand-in models tests hand engines, by the names test helpers use.

An engine config cannot name one (a deployment config is data); test helpers
take ``executor`` (one of these names) and ``executor_options`` (its fields)
beside the engine config's keys, and hand the engine the object.
"""

from __future__ import annotations

from iterserve.scheduler.fake_executor import FakeModel


def stand_in(kind: str = "fake", **options) -> FakeModel:
    from tests.faults import Faulty
    from tests.serve.echo import Echo

    kinds: dict[str, type[FakeModel]] = {"fake": FakeModel, "faulty": Faulty, "echo": Echo}
    return kinds[kind](**options)


def split(config: dict) -> tuple[dict, FakeModel | None]:
    """A test's engine config without its stand-in, and the stand-in (None: the
    model)."""
    config = dict(config)
    kind = config.pop("executor", None)
    options = config.pop("executor_options", {})
    return config, None if kind is None else stand_in(kind, **options)

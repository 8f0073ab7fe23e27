"""An engine that fails to start leaves nothing behind: no actor, no reservation."""

from __future__ import annotations

import json
import time

import pytest

from iterserve.cluster.engine.api import LLM

pytestmark = pytest.mark.usefixtures("ray_session")


def _held() -> tuple[float, int]:
    """CPUs this session's Ray has free, and its placement groups still reserved."""
    import ray

    groups = ray.util.placement_group_table().values()
    reserved = sum(group["state"] in ("CREATED", "PENDING", "RESCHEDULING") for group in groups)
    return ray.available_resources().get("CPU", 0.0), reserved


def _steady(timeout_s: float = 30.0) -> tuple[float, int]:
    """What is held once the engines of earlier tests have let go of theirs."""
    deadline = time.monotonic() + timeout_s
    last = _held()
    while time.monotonic() < deadline:
        time.sleep(1.0)
        if (now := _held()) == last:
            return now
        last = now
    return last


def _settled(expected: tuple[float, int], timeout_s: float = 30.0) -> tuple[float, int]:
    deadline = time.monotonic() + timeout_s
    while (held := _held()) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return held


def test_a_refused_checkpoint_releases_the_engines_actors_and_cpus(tmp_path):
    """Each failed ``LLM(...)`` used to keep its scheduler actor, ranks and their CPU
    reservation: after two, the next start waited for CPUs forever, without a word."""
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    before = _steady()
    for _ in range(2):
        with pytest.raises(Exception, match="GPT2LMHeadModel"):
            LLM(model=str(bad), num_cpus_per_worker=0.5)
    assert _settled(before) == before

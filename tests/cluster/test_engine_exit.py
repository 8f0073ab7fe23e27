"""The offline API closes itself: a script that uses ``LLM`` or ``AsyncEngine``
and never calls ``shutdown`` exits 0 with a clean stderr (no traceback, no
"Task was destroyed but it is pending!"), and the engines it dropped or left
open are shut down in order: their actors and ranks end and their socket
directories are gone. The context managers do the same at the block's end.

Each script runs as a user runs one: a process of its own, with a Ray of its
own (the environment before this session touched it), its temporary files in a
directory of the test's, so that what it leaves there can be seen.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil

from tests.conftest import USER_ENV

RUN_TIMEOUT_S = 300

# What each script shares: a small engine, and what it reports of one (its rank
# processes and its socket directory) so that the test can look for them after.
PRELUDE = """
import asyncio, gc, json, os, time
import ray
from iterserve.cluster.engine.api import LLM, AsyncEngine
from iterserve.cluster.config import EngineConfig
from iterserve.scheduler import FakeModel, SamplingParams

SMALL = dict(dtype="float32", max_model_len=64, num_kv_blocks=64, block_size=4,
             max_num_seqs=4, max_num_batched_tokens=64, num_cpus_per_worker=0.25,
             torch_threads=1)
GREEDY = SamplingParams(max_tokens=4, temperature=0)

def fake():
    config = EngineConfig.from_dict({k: v for k, v in SMALL.items() if k != "dtype"})
    return config, FakeModel(output_len=4, max_model_len=64, vocab_size=100)

async def held(engine):
    ranks = [w["pid"] for w in await engine.actor.worker_nodes.remote()]
    return {"ranks": ranks, "dir": os.path.dirname(engine.info["endpoint"]["unix"])}

def report(name, what):
    print(json.dumps({"name": name, **what}), flush=True)

def released(what, timeout_s=30.0):
    # the ranks ended and the engine removed its socket directory
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [pid for pid in what["ranks"] if _alive(pid)]
        if not alive and not os.path.exists(what["dir"]):
            return True
        time.sleep(0.2)
    return False

def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
"""


def _run(script: str) -> tuple[subprocess.CompletedProcess, dict[str, dict]]:
    """Runs ``script`` after the prelude; its result and the engines it reported."""
    tmp = tempfile.mkdtemp(prefix="ix-", dir="/tmp")  # short: Ray's socket paths live under it
    env = {**USER_ENV, "TMPDIR": tmp}
    env.pop("RAY_ADDRESS", None)
    code = PRELUDE + textwrap.dedent(script)
    try:
        result = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
        )  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    engines = {}
    for line in result.stdout.splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            engines[entry.pop("name")] = entry
    return result, engines


def _assert_clean_exit(result: subprocess.CompletedProcess) -> None:
    output = f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    assert result.returncode == 0, output
    for mark in ("Traceback", "Task was destroyed", "Exception ignored", "Event loop is closed"):
        assert mark not in result.stderr, output


def _assert_released(what: dict, timeout_s: float = 30.0) -> None:
    """The engine's ranks ended and its socket directory is gone (an engine killed
    instead of shut down leaves the directory behind)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [pid for pid in what["ranks"] if _alive(pid)]
        if not alive and not os.path.exists(what["dir"]):
            return
        time.sleep(0.2)
    assert not os.path.exists(what["dir"]), what
    assert not [pid for pid in what["ranks"] if _alive(pid)], what


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_script_that_leaves_llm_open_exits_cleanly_and_releases_it():
    result, engines = _run(
        """
        dropped = LLM(model=None, **SMALL)  # the bundled demo model
        dropped.generate(["A decorator is"], GREEDY)
        what = dropped.loop.run_until_complete(held(dropped.engine))
        del dropped
        gc.collect()
        print("collected released:", released(what), flush=True)
        llm = LLM(model=None, **SMALL)
        print(llm.generate(["A decorator is"], GREEDY)[0].token_ids, flush=True)
        report("left open", llm.loop.run_until_complete(held(llm.engine)))
        """
    )
    _assert_clean_exit(result)
    assert "collected released: True" in result.stdout, result.stdout
    _assert_released(engines["left open"])


def test_a_script_that_leaves_async_engines_open_exits_cleanly_and_releases_them():
    result, engines = _run(
        """
        async def main():
            config, model = fake()
            dropped = await AsyncEngine(config, model).start()
            async for _ in dropped.generate([1, 2, 3], GREEDY):
                pass
            what = await held(dropped)
            del dropped
            gc.collect()  # inside the running loop: the release must not block it
            print("collected released:", await asyncio.to_thread(released, what), flush=True)
            engine = await AsyncEngine(config, model).start()
            async for out in engine.generate([1, 2, 3], GREEDY):
                pass
            report("left open", await held(engine))

        asyncio.run(main())
        """
    )
    _assert_clean_exit(result)
    assert "collected released: True" in result.stdout, result.stdout
    _assert_released(engines["left open"])


def test_the_context_managers_release_at_the_blocks_end():
    result, engines = _run(
        """
        with LLM(model=None, **SMALL) as llm:
            llm.generate(["A decorator is"], GREEDY)
            what = llm.loop.run_until_complete(held(llm.engine))
        print("llm released:", released(what), flush=True)
        llm.shutdown()  # a second time: nothing

        async def main():
            config, model = fake()
            async with AsyncEngine(config, model) as engine:
                async for _ in engine.generate([1, 2, 3], GREEDY):
                    pass
                what = await held(engine)
            print("engine released:", await asyncio.to_thread(released, what), flush=True)
            await engine.shutdown()

        asyncio.run(main())
        """
    )
    _assert_clean_exit(result)
    assert "llm released: True" in result.stdout, result.stdout
    assert "engine released: True" in result.stdout, result.stdout

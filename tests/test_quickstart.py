"""The README's first command, run the way a user runs it.

``iterserve serve`` as a subprocess: no ``--config``, no environment set by this
test session, Ray started by the CLI itself and sized by this machine. It must
become healthy, serve the official ``openai`` client, and on SIGTERM leave no
process behind within 15 seconds. The same for ``serve run`` of the example
Serve config against a ``ray start --head`` cluster this test starts.

These tests start their own Ray instances beside the session's (the ports and
the session directories are their own), so they never touch the suite's Ray.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
import yaml

from iterserve.scheduler import SchedulerConfig
from tests.conftest import USER_ENV

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
READY_TIMEOUT_S = 300  # a cold start on a loaded CI machine
EXIT_TIMEOUT_S = 15


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_serve(tmp_path: Path) -> tuple[subprocess.Popen, str, Path]:
    """``iterserve serve`` as the README runs it (no config), on a free port, in a
    session of its own; its process, URL and log file."""
    port = _free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(BIN / "iterserve"), "serve", "--port", str(port)],
            cwd=tmp_path, env=USER_ENV, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}", log


def _wait_healthy(url: str, proc: subprocess.Popen | None, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the server exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"not healthy within {READY_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def _drive_with_openai(url: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    (model,) = [m.id for m in client.models.list()]
    assert model == "demo"
    out = client.completions.create(model=model, prompt="A decorator is", max_tokens=12)
    assert out.choices[0].text and out.usage.completion_tokens <= 12
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What does json.dumps do?"}],
        max_tokens=12,
    )  # fmt: skip
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is a list?"}],
            max_tokens=12,
            stream=True,
        )  # fmt: skip
        if chunk.choices
    ]
    assert "".join(pieces)


def _ray_processes(marker: str) -> list[psutil.Process]:
    """Live processes whose command line names ``marker`` (a Ray session directory)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(marker in part for part in proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:  # gone, or a zombie
        return ""


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _alive(procs)


def _ray_stop(marker: str) -> list[psutil.Process]:
    """What ``ray stop`` does, for one cluster only (``ray stop`` would also stop the
    suite's own Ray): SIGTERM the raylet, then every other process, then the GCS,
    each with a grace period. Returns what outlived its grace (then killed)."""
    cluster = _ray_processes(marker)
    raylets = [p for p in cluster if "raylet/raylet" in _cmdline(p)]
    gcs = [p for p in cluster if "gcs_server" in _cmdline(p)]
    others = [p for p in cluster if p not in raylets and p not in gcs]
    survivors = []
    for bucket in (raylets, others, gcs):
        for p in bucket:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        left = _wait_gone(bucket, EXIT_TIMEOUT_S / 3)
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        survivors += left
    return survivors


def _session_dir(procs: list[psutil.Process]) -> str:
    for proc in procs:
        for part in proc.cmdline():
            if "--session_dir=" in part or "--session-dir=" in part:
                return part.split("=", 1)[1]
    pytest.fail("no Ray session directory in the server's process tree")


def test_iterserve_serve_comes_up_with_no_config_and_leaves_nothing_behind(tmp_path):
    proc, url, log = _start_serve(tmp_path)
    try:
        _wait_healthy(url, proc, log)
        _drive_with_openai(url)
        # No config: the step budget derived for this machine's device and the model.
        from iterserve.cluster.ranks.executors import cpu_step_tokens
        from iterserve.models import DEMO_MODEL_PATH
        from iterserve.workers.checkpoint import load_checkpoint

        replicas = httpx.get(f"{url}/v1/stats", timeout=30).json()["replicas"]
        device = "cuda" if torch.cuda.is_available() else "cpu"
        config = load_checkpoint(DEMO_MODEL_PATH).config
        step_tokens = cpu_step_tokens(config) if device == "cpu" else None
        expected = SchedulerConfig().step_budget(device, step_tokens=step_tokens)
        assert [r["max_num_batched_tokens"] for r in replicas] == [expected]
        # No config: the dtype `auto` picks for this machine, reported with why and
        # on which instruction set: by rule, or measured where no rule holds.
        from iterserve.kernels.cpu import isa
        from iterserve.workers.dtype import choose_dtype

        version = httpx.get(f"{url}/version", timeout=30).json()
        if device == "cpu" and isa.level() == "avx512_bf16":
            assert "measured at load" in version["dtype_reason"]
        else:
            choice = choose_dtype("auto", config.torch_dtype, device)
            assert (version["dtype"], version["dtype_reason"]) == (choice.name, choice.reason)
        assert version["isa"].startswith(isa.level()) and version["kernels"]
        assert f"in {version['dtype']} ({version['dtype_reason']}) on {version['isa']}" in (
            log.read_text()
        )
        tree = psutil.Process(proc.pid).children(recursive=True)
        session = _session_dir(tree)
        assert len(tree) > 3, "Ray's processes should be the server's children"
        proc.send_signal(signal.SIGTERM)
        proc.wait(EXIT_TIMEOUT_S)
        left = _wait_gone(tree, 2) + _ray_processes(session)
        assert not _alive(left), [p.info for p in left]
        assert "shutting down" in log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_serve_run_of_the_example_config_on_a_cluster_started_with_ray_start(tmp_path):
    config = yaml.safe_load((ROOT / "deploy" / "serve-config.example.yaml").read_text())
    port, ray_port = _free_port(), _free_port()
    (app,) = config["applications"]
    app["args"]["http_port"] = port  # the example's 8000 may be taken here
    config_path = tmp_path / "serve-config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    # This cluster's sessions, apart from the suite's Ray (a short path: Ray's Unix
    # socket paths under it must stay within 107 bytes).
    temp_dir = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))
    head = subprocess.run(
        [str(BIN / "ray"), "start", "--head", f"--port={ray_port}",
         "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"],
        env=USER_ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert head.returncode == 0, head.stdout + head.stderr
    # What `ray start` prints for others to connect: the node's address, not loopback.
    address = re.search(r"--address='([^']+)'", head.stdout).group(1)
    # Named explicitly (another Ray may be the latest on this machine), the address
    # needs the token mode said too: `ray start` enabled token authentication.
    env = {**USER_ENV, "RAY_ADDRESS": address, "RAY_AUTH_MODE": "token"}
    log = tmp_path / "serve-run.log"
    proc = None
    try:
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [str(BIN / "serve"), "run", str(config_path)],
                cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc, log)
        _drive_with_openai(url)
        proc.send_signal(signal.SIGTERM)
        proc.wait(EXIT_TIMEOUT_S)
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        left = _ray_stop(str(temp_dir))
    assert not left, [_cmdline(p)[:120] for p in left]
    assert not _alive(_ray_processes(str(temp_dir)))
    shutil.rmtree(temp_dir, ignore_errors=True)

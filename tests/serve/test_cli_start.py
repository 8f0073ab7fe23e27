"""The real ``iterserve serve`` command: a vLLM command line starts it, and whatever
stops it from starting ends it with one line naming the problem and a non-zero code."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import USER_ENV
from tests.test_quickstart import BIN, _free_port, _wait_healthy


def _serve(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "iterserve"), "serve", *args],
        cwd=cwd, env=USER_ENV, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@contextlib.contextmanager
def _serving(args: list[str], cwd: Path, log: Path):
    """``iterserve serve ARGS`` (``--port`` among them) healthy for the block; then
    SIGTERM, which must end it with exit code 0."""
    port = args[args.index("--port") + 1]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(BIN / "iterserve"), "serve", *args], cwd=cwd, env=USER_ENV,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc, log)
        yield
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def quantized_checkpoint(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with a quantization_config of a method not served, which the
    loader refuses."""
    path = tmp_path_factory.mktemp("refused") / "tiny-bnb"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def w8a8_checkpoint(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model as compressed-tensors' W8A8 int8 (round to nearest)."""
    from iterserve.workers.quant.write import quantize_checkpoint

    return quantize_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("w8a8") / "tiny-w8a8",
                               "w8a8")  # fmt: skip


@pytest.mark.parametrize(
    "args, reason, code",
    [
        (["{quantized}"], "config.json: quantization_config.quant_method is 'bitsandbytes'", 2),
        (["{w8a8}", "--quantization", "gptq"],
         "quantization: 'gptq', but the checkpoint's quantization_config says "
         "'compressed-tensors'", 2),
        (["{tiny}", "-q", "awq"], "quantization: 'awq', but the checkpoint has no "
         "quantization_config", 2),
        (["{tiny}", "--max-num-seqs", "abc"], "--max-num-seqs abc: must be an integer", 2),
        (["{tiny}", "--gpu-memory-utilization", "1.5"],
         "--gpu-memory-utilization 1.5: kv_memory_fraction must be <= 1", 2),
        (["{tiny}", "--config", "{bad_yaml}"], "not YAML at line 2", 2),
        (["{tiny}", "--config", "{missing}"], "No such file or directory", 2),
        (["{tiny}", "--pipeline-parallel-size", "2"], "vLLM's flag is not implemented", 2),
        (["{tiny}", "--no-such-flag"], "--no-such-flag is a flag of neither iterserve nor", 2),
        (["Org/not-in-the-cache"], "iterserve downloads nothing", 2),
        (["{tiny}", "--chat-template", "{missing}"], "chat_template: no file", 2),
    ],
)  # fmt: skip
def test_what_cannot_start_ends_with_one_sentence(
    args, reason, code, tiny_model_dir, quantized_checkpoint, w8a8_checkpoint, tmp_path
):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("max-num-seqs: [\n")
    names = dict(tiny=tiny_model_dir, quantized=quantized_checkpoint, w8a8=w8a8_checkpoint,
                 bad_yaml=bad_yaml, missing=tmp_path / "missing.yaml")  # fmt: skip
    env_cache = {**USER_ENV, "HF_HUB_CACHE": str(tmp_path / "hub")}
    done = subprocess.run(
        [str(BIN / "iterserve"), "serve", *(a.format(**names) for a in args),
         "--port", str(_free_port())],
        cwd=tmp_path, env=env_cache, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == code, done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("iterserve serve: "), done.stderr
    assert reason in lines[0], lines[0]
    assert "Traceback" not in done.stdout + done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton kernels need no CUDA there")
def test_a_start_that_fails_on_the_ranks_ends_with_one_sentence_and_its_log(
    tiny_model_dir, tmp_path
):
    """The ranks fail to load (the Triton kernels on a CPU, no interpreter): one line
    from Ray's nested task errors, exit code 1, the traceback in the log it names."""
    done = _serve(str(tiny_model_dir), "--kernel-backend", "triton", "--dtype", "float32",
                  "--port", str(_free_port()), cwd=tmp_path, timeout=300)  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("iterserve serve: ") and "needs CUDA tensors" in line, line
    log = Path(line.rsplit("(traceback: ", 1)[1].rstrip(")"))
    assert "Traceback (most recent call last)" in log.read_text()
    assert "iterserve: serving" not in done.stdout


def test_log_level_debug_prints_the_traceback_too(quantized_checkpoint, tmp_path):
    done = _serve(str(quantized_checkpoint), "--log-level", "debug", cwd=tmp_path)
    assert done.returncode == 2
    assert "Traceback (most recent call last)" in done.stderr
    assert done.stderr.rstrip().splitlines()[-1].startswith("iterserve serve: config.json")


@pytest.mark.slow
def test_a_vllm_command_line_starts_the_server(tiny_model_dir, tmp_path):
    """vLLM's flags, unchanged: the served names, the key, the accepted no-ops; then a
    SIGTERM ends it with exit code 0."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    line = [
        str(tiny_model_dir), "--dtype", "float32", "--max-model-len", "128",
        "--max-num-seqs", "4", "--gpu-memory-utilization", "0.5", "--enable-prefix-caching",
        "--enforce-eager", "--trust-remote-code", "--disable-log-requests",
        "--served-model-name", "tiny", "tiny-alias", "--api-key", "k-123", "--seed", "1",
        "--port", str(port),
    ]  # fmt: skip
    with _serving(line, tmp_path, log):
        auth = {"Authorization": "Bearer k-123"}
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        models = httpx.get(f"{url}/v1/models", headers=auth, timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny", "tiny-alias"]
        body = {"model": "tiny-alias", "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 3}  # fmt: skip
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth, timeout=60)
        assert answer.status_code == 200 and answer.json()["model"] == "tiny"
    text = log.read_text()
    assert "--enforce-eager: accepted, nothing to do" in text
    assert "kv_memory_fraction=0.5 (--gpu-memory-utilization)" in text
    assert "k-123" not in text  # the key is never printed
    assert "Traceback" not in text, text


@pytest.mark.slow
def test_a_w8a8_checkpoint_serves_with_no_other_flag(w8a8_checkpoint, tmp_path):
    """The quantization is read from the checkpoint: the server starts, says so in its
    start-up line and in /version (the scheme, the int8 product's kernel), and
    answers."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with _serving([str(w8a8_checkpoint), "--port", str(port)], tmp_path, log):
        version = httpx.get(f"{url}/version", timeout=10).json()
        assert version["quantization"].startswith("compressed-tensors: W8A8 int8"), version
        assert version["kernels"]["linear.w8a8"] in ("amx_int8", "onednn_int8"), version
        body = {"model": "tiny-w8a8", "prompt": "hello there", "max_tokens": 4, "ignore_eos": True}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4
    text = log.read_text()
    assert ", weights compressed-tensors: W8A8 int8" in text, text
    assert "Traceback" not in text, text

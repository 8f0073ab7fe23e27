"""A port belongs to one server. A second server started on a port another one
serves refuses to start, naming the port and the holder, and the first answers
every request sent while the second tried and after: ``iterserve serve`` twice,
as a user runs it, and a second Serve app on the port of an app of the same
cluster (the ingress's own check, which ``serve run`` deployments meet)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading

import httpx
import pytest
from ray import serve

from tests.serve.conftest import MODEL, deploy, fake_engine, undeploy
from tests.test_quickstart import BIN, READY_TIMEOUT_S, USER_ENV, _start_serve, _wait_healthy


class Requests:
    """Completions sent one after another from a thread until stopped; what each
    answered (status, and the model that answered it)."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self.answers: list[tuple[int, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Requests:
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop.set()
        self.thread.join(60)

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "hello", "max_tokens": 2}
        while not self.stop.is_set():
            self.answers.append(_ask(self.url, body))


def _ask(url: str, body: dict) -> tuple[int, str]:
    try:
        # A connection each: the kernel picks a listener per connection.
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    except httpx.HTTPError as exc:
        return 0, repr(exc)
    return r.status_code, r.json().get("model", r.text) if r.status_code == 200 else r.text


def _every_answer_from(answers: list[tuple[int, str]], model: str) -> None:
    assert answers, "no request was sent"
    assert set(answers) == {(200, model)}, [a for a in answers if a != (200, model)][:5]


def test_a_second_iterserve_serve_on_a_port_in_use_refuses_and_the_first_serves_on(tmp_path):
    first, url, log = _start_serve(tmp_path)
    port = int(url.rsplit(":", 1)[1])
    try:
        _wait_healthy(url, first, log)
        with Requests(url, "demo") as meanwhile:
            second = subprocess.run(
                [str(BIN / "iterserve"), "serve", "--port", str(port),
                 "--served-model-name", "second"],
                cwd=tmp_path, env=USER_ENV, capture_output=True, text=True,
                timeout=READY_TIMEOUT_S,
            )  # fmt: skip
        output = second.stdout + second.stderr
        assert second.returncode != 0, output
        # The first server's own command: the ingress's parent's parent.
        assert f"port {port} is in use by another server (pid {first.pid}, iterserve serve" in (
            output
        ), output
        assert "iterserve: serving" not in output, output
        _every_answer_from(meanwhile.answers, "demo")
        after = [_ask(url, {"model": "demo", "prompt": "hi", "max_tokens": 2}) for _ in range(10)]
        _every_answer_from(after, "demo")
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)


async def test_a_second_app_on_the_port_of_another_is_refused_and_the_first_serves_on(
    serve_url, tokenizer_dir, vocab_size
):
    config = fake_engine(vocab_size)
    url = await asyncio.to_thread(
        deploy, serve_url, "port-first", model=str(tokenizer_dir), config=config
    )
    port = int(url.rsplit(":", 1)[1])
    try:
        with Requests(url, MODEL) as meanwhile:
            with pytest.raises(Exception, match="port-second failed"):
                await asyncio.to_thread(
                    deploy, serve_url, "port-second", model=str(tokenizer_dir),
                    model_name="second", config=config, http_port=port,
                )  # fmt: skip
        # What Serve says of the ingress that did not start: the replica's own error.
        status = serve.status().applications["port-second"].deployments["OpenAIIngress"]
        assert f"port {port} is in use by another server (pid " in status.message, status
        _every_answer_from(meanwhile.answers, MODEL)
        after = [await asyncio.to_thread(_ask, url, {"model": MODEL, "prompt": "hi", "max_tokens": 2})
                 for _ in range(10)]  # fmt: skip
        _every_answer_from(after, MODEL)
    finally:
        await asyncio.to_thread(undeploy, "port-second")
        await asyncio.to_thread(undeploy, "port-first")

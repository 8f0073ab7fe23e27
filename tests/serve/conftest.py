"""The Serve app on the session's Ray: one HTTP server for the session, one app per module.

Checkpoints are built here: a byte-level BPE tokenizer (with a chat template)
for the fake executor, and the same tokenizer next to a tiny random Llama for
text-level tests. With the fake executor the text is whatever the tokenizer
decodes the fake's (predictable) tokens to.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
import pytest

CORPUS = [
    "hello world, this is a tiny corpus for a tiny tokenizer.",
    "héllo wörld ✓ 日本語のテキスト and some more words",
    "the quick brown fox jumps over the lazy dog 🦊",
    "user assistant system: say something nice about the weather today",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
API_KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "tiny-chat"  # the tokenizer directory's name: the default served name


def build_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<pad>", "<s>", "</s>"],  # ids 0, 1, 2: the fake's EOS is 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_engine(vocab_size: int, **overrides) -> dict:
    """An EngineConfig dict for the fake executor (tokens in the tokenizer's vocabulary)."""
    options = {"output_len": 12, "max_model_len": 128, "vocab_size": vocab_size}
    options.update(overrides.pop("executor_options", {}))
    config = dict(
        executor="fake",
        executor_options=options,
        num_kv_blocks=256,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        block_size=4,
        num_cpus_per_worker=0.1,
    )
    config.update(overrides)
    return config


def tiny_model_engine(**overrides) -> dict:
    """An EngineConfig dict for a tiny real checkpoint on the CPU: fp32 on the torch
    kernels, a short context, a fraction of a CPU per rank."""
    config = dict(
        dtype="float32",
        kernel_backend="torch",
        max_model_len=128,
        num_kv_blocks=256,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        num_cpus_per_worker=0.1,
        torch_threads=1,
    )
    config.update(overrides)
    return config


@pytest.fixture
def http(app):
    """The TestClient of a module's in-process ``app`` fixture (:func:`inproc`)."""
    return app[0]


@pytest.fixture
def client(http):
    """The official ``openai`` client over it."""
    return openai_client(http)


def openai_client(http):
    """The official ``openai`` client over an in-process app's TestClient."""
    import openai

    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                         max_retries=0)  # fmt: skip


def deploy(serve_url: str, name: str, *, behind_proxy: bool = False, **args) -> str:
    """Runs the app; returns its base URL once the engines answer. As ``iterserve
    serve`` runs it, the ingress answers HTTP itself, on a port of its own;
    ``behind_proxy`` puts it under /<name> of Serve's proxy instead. The config's
    ``executor``/``executor_options`` (test helpers' keys) become the stand-in
    model handed to the app in code; ``api_key`` becomes the name of the
    environment variable the session set it in (tests/conftest.py)."""
    from ray import serve

    from iterserve.cluster.serve.app import build_application
    from tests.conftest import api_key_env
    from tests.stand_ins import split

    url = f"{serve_url}/{name}"
    if not behind_proxy:
        args.setdefault("http_port", _free_port())
        url = f"http://127.0.0.1:{args['http_port']}"
    args["config"], executor = split(args.get("config", {}))
    if "api_key" in args:
        args["api_key_env"] = api_key_env(args.pop("api_key"))
    serve.run(build_application(args, executor), name=name, route_prefix=f"/{name}")
    engine = serve.get_deployment_handle("EngineServer", name)
    engine.broadcast("info").results(timeout_s=120)
    _wait_answering(url)
    return url


def _wait_answering(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            httpx.get(f"{url}/health", timeout=5)
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.fixture(scope="session")
def api_url(serve_url, tokenizer_dir, vocab_size) -> str:
    """The fake-executor app most API tests share, with an API key and a 64 KiB body limit."""
    name = "api"
    yield deploy(
        serve_url,
        name,
        model=str(tokenizer_dir),
        config=fake_engine(vocab_size),
        api_key=API_KEY,
        max_body_bytes=65536,
    )
    undeploy(name)


def undeploy(name: str) -> None:
    from ray import serve

    serve.delete(name)


async def engine_replicas(name: str, method: str) -> list:
    """Calls ``method`` on every engine replica of app ``name``."""
    from ray import serve

    engine = serve.get_deployment_handle("EngineServer", name)
    return await engine.broadcast(method).results_async(timeout_s=60)


async def assert_engines_sound(name: str) -> None:
    """Every engine replica of app ``name`` is healthy: each checks its allocators
    itself whenever it goes idle (every slot and block free, no request lost) and
    would have ended, unhealthy, on a failure. Call it once they are idle."""
    for status in await engine_replicas(name, "health"):
        assert status["healthy"], status


async def rank_pids(name: str) -> list[list[int]]:
    """Per engine replica of app ``name``, its ranks' process ids in rank order."""
    return [[w["pid"] for w in p["workers"]] for p in await engine_replicas(name, "placement")]


async def wait_idle(client: httpx.AsyncClient, timeout_s: float = 20.0) -> dict:
    """/v1/stats once no slot and no KV block is held any more (aborts free at the
    next step); the last stats seen when that does not happen in time."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = (await client.get("/v1/stats")).json()
        idle = stats["slots_used"] == 0 and stats["kv_blocks_used"] == 0
        if idle and stats["num_waiting"] == 0 or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


async def stream_completion(client, body: dict, *, headers: dict | None = None,
                            on_event=None) -> tuple[list, bool]:  # fmt: skip
    """Streams ``/v1/completions``: its JSON events, and whether it ended with
    [DONE]. ``on_event(events)`` runs after each event; when it answers true, the
    client leaves (closing the response drops the connection)."""
    events: list = []
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return events, True
            events.append(json.loads(line.removeprefix("data: ")))
            if on_event is not None and on_event(events):
                return events, False
    return events, False


def sse_events(lines) -> list:
    """The JSON payloads of an SSE body (as lines), checking it ends in [DONE]."""
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


@pytest.fixture(scope="session")
def tools_tokenizer_dir(tmp_path_factory) -> Path:
    """A tokenizer whose chat template renders tools (see tests/serve/echo.py)."""
    from tests.serve.echo import build_tools_tokenizer

    return build_tools_tokenizer(tmp_path_factory.mktemp("serve") / "tiny-tools")


def inproc(tokenizer_dir: Path, settings: dict | None = None, **serving_options):
    """The HTTP API over the in-process echo engine, without Ray: a starlette
    TestClient and the engine (whose ``opened`` lists every request it got)."""
    from starlette.testclient import TestClient

    from iterserve.cluster.openai.app import APISettings, build_api
    from iterserve.cluster.openai.serving import OpenAIServing
    from iterserve.workers.tokenizer import Tokenizer
    from tests.serve.echo import EchoEngine

    tokenizer = Tokenizer(tokenizer_dir)
    engine = EchoEngine(tokenizer, pooling=serving_options.get("runner") == "pooling")
    options = dict(model_name=MODEL, max_n=4, max_logprobs=5, request_timeout_s=30)
    serving = OpenAIServing(engine, tokenizer, **{**options, **serving_options})

    async def metrics_body() -> bytes:
        return b"# no metrics here\n"

    app = build_api(serving, APISettings(**(settings or {})), metrics_body)
    return TestClient(app), engine

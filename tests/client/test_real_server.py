"""The client against the real Serve app (fake executor): every method, sync and async.

The fake's tokens depend only on each request's label, ``<X-Request-Id>-<choice>``:
two requests sent with the same ``X-Request-Id`` produce the same text, so a
streamed answer can be compared with a whole one.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

pytest.importorskip(
    "iterserve.cluster.serve.app", reason="the Serve app (cluster/serve/app.py) is not built yet"
)

from iterserve_client import (  # noqa: E402
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    ChatCompletion,
    ChatCompletionChunk,
    Client,
    Completion,
    CompletionChunk,
    NotFoundError,
    Response,
    ResponseEvent,
)

from iterserve.scheduler import FakeModel  # noqa: E402
from tests.client.util import collect, resolve  # noqa: E402
from tests.conftest import api_key_env  # noqa: E402
from tests.serve.conftest import build_tokenizer  # noqa: E402

APP = "client-sdk"
API_KEY = "client-key"
MODEL = "tiny-client"
MAX_NUM_SEQS = 4
ENGINE_CONFIG = {
    "num_kv_blocks": 128,
    "max_num_seqs": MAX_NUM_SEQS,
    "max_num_batched_tokens": 128,
    "block_size": 4,
    "num_cpus_per_worker": 0.1,
}
IDLE_WAIT_S = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(ray_session, tmp_path_factory):
    """The app under ``/client-sdk``. Serve is started here unless it already runs
    in this session (then its proxy is shared and only this app is removed)."""
    from ray import serve
    from ray.serve.context import _get_global_client

    from iterserve.cluster.serve.app import build_application
    from iterserve.workers.tokenizer import Tokenizer

    running = _get_global_client(raise_if_no_controller_running=False)
    if running is None:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
    else:
        port = running.http_config.port
    tokenizer_dir = build_tokenizer(tmp_path_factory.mktemp("client") / "tok")
    # No EOS of its own: a request runs until max_tokens, one token per 20 ms step.
    fake = FakeModel(output_len=None, max_model_len=128, step_sleep_s=0.02,
                     vocab_size=Tokenizer(tokenizer_dir).vocab_size)  # fmt: skip
    args = {"model": str(tokenizer_dir), "config": ENGINE_CONFIG, "num_engine_replicas": 1,
            "api_key_env": api_key_env(API_KEY), "model_name": MODEL}  # fmt: skip
    serve.run(build_application(args, fake), name=APP, route_prefix=f"/{APP}")
    serve.get_deployment_handle("EngineServer", APP).broadcast("info").results(timeout_s=120)
    yield f"http://127.0.0.1:{port}/{APP}"
    serve.delete(APP)
    if running is None:
        serve.shutdown()


@pytest.fixture
async def make(kind, server):
    clients = []

    def make(**kwargs):
        cls = Client if kind == "sync" else AsyncClient
        client = cls(server, **{"api_key": API_KEY, "timeout": 60.0, **kwargs})
        clients.append(client)
        return client

    yield make
    for client in clients:
        await resolve(client.close())


async def wait_idle(client, timeout_s: float = IDLE_WAIT_S):
    """Stats once no slot and no KV block is held (aborts free at the next step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await resolve(client.stats())
        if stats.slots_used == 0 and stats.kv_blocks_used == 0 or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


def aborted(stats) -> int:
    return sum(e.raw.get("counters", {}).get("finished_abort", 0) for e in stats.engines)


async def test_models_health_and_stats(make):
    client = make()
    assert [m.id for m in await resolve(client.models())] == [MODEL]
    health = await resolve(client.health())
    assert health and health.status_code == 200 and health.message == "ok"
    stats = await wait_idle(client)
    assert stats.policy == "chunked" and stats.slots_total == MAX_NUM_SEQS
    assert stats.kv_blocks_total == 128 and len(stats.engines) == 1
    assert (stats.num_running, stats.slot_utilization, stats.kv_usage) == (0, 0.0, 0.0)


async def test_completion_whole_and_streamed_agree(make, kind):
    client = make(headers={"X-Request-Id": f"same-{kind}"})
    out = await resolve(
        client.completions.create(model=MODEL, prompt="hello world", max_tokens=5, logprobs=2)
    )
    assert isinstance(out, Completion) and out.model == MODEL
    (choice,) = out.choices
    assert choice.finish_reason == "length" and choice.text
    assert len(choice.logprobs.tokens) == 5 and len(choice.logprobs.top_logprobs[0]) <= 2
    assert out.usage.completion_tokens == 5 and out.usage.prompt_tokens > 0

    stream = await resolve(
        client.completions.create(
            model=MODEL, prompt="hello world", max_tokens=5, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    chunks = await collect(stream)
    assert all(isinstance(c, CompletionChunk) for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == 5 and stream.closed


async def test_completion_with_n_and_several_prompts(make):
    out = await resolve(
        make().completions.create(model=MODEL, prompt=["a b", "c d"], n=2, max_tokens=2, seed=1)
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 8


async def test_chat_whole_and_streamed_agree(make, kind):
    client = make(headers={"X-Request-Id": f"chat-{kind}"})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    out = await resolve(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, logprobs=True, top_logprobs=2
        )
    )
    assert isinstance(out, ChatCompletion)
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert len(choice.logprobs.content) == 4
    assert 1 <= len(choice.logprobs.content[0].top_logprobs) <= 2  # the fake offers one

    stream = await resolve(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True)
    )
    chunks = await collect(stream)
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_responses_whole_streamed_stored_and_deleted(make, kind):
    client = make(headers={"X-Request-Id": f"responses-{kind}"})
    out = await resolve(
        client.responses.create(model=MODEL, input="hello", max_output_tokens=4, store=True)
    )
    assert isinstance(out, Response) and out.status == "incomplete"  # max_output_tokens cut it
    (message,) = out.output
    assert message.type == "message" and out.output_text == message.text
    assert out.usage.output_tokens == 4 and out.usage.reasoning_tokens == 0
    stream = await resolve(
        client.responses.create(model=MODEL, input="hello", max_output_tokens=4, stream=True)
    )
    events = await collect(stream)
    assert all(isinstance(e, ResponseEvent) for e in events)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == out.output_text  # the same X-Request-Id, the same tokens
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == text
    assert (await resolve(client.responses.retrieve(out.id))).output_text == text
    await resolve(client.responses.delete(out.id))
    with pytest.raises(NotFoundError):
        await resolve(client.responses.retrieve(out.id))


async def test_errors_from_the_server_are_typed(make):
    with pytest.raises(AuthenticationError) as info:
        await resolve(make(api_key="wrong").models())
    assert info.value.status_code == 401 and info.value.request_id
    client = make()
    with pytest.raises(NotFoundError) as info:
        await resolve(client.completions.create(model="nope", prompt="hi", max_tokens=1))
    assert info.value.code == "model_not_found"
    with pytest.raises(BadRequestError) as info:
        await resolve(client.completions.create(model=MODEL, prompt="hi", temperature=9.0))
    assert info.value.param == "temperature" and info.value.request_id


async def test_breaking_out_of_a_stream_frees_the_request(make, kind):
    client = make()
    before = aborted(await wait_idle(client))
    stream = await resolve(
        client.completions.create(model=MODEL, prompt="hello", max_tokens=100, stream=True)
    )
    seen = 0
    if kind == "async":
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
    else:
        for _ in stream:
            seen += 1
            if seen == 2:
                break
    stats = await wait_idle(client)
    assert (stats.slots_used, stats.kv_blocks_used, stats.num_waiting) == (0, 0, 0)
    assert aborted(stats) == before + 1  # ended by the abort, not by running out


async def test_the_operator_routes(make, kind):
    """pause (keep) holds a request until resume; sleep and wake_up bring it home."""
    client = make()
    answer = await resolve(client.pause(mode="keep"))
    assert answer["status"] == "paused" and answer["num_engine_replicas"] == 1
    assert await resolve(client.is_paused()) is True
    waiting = asyncio.ensure_future(
        asyncio.to_thread(
            Client(client.base_url, api_key=API_KEY, timeout=60).completions.create,
            model=MODEL, prompt="hi", max_tokens=3,
        )
    )  # fmt: skip
    await asyncio.sleep(0.3)
    assert not waiting.done()
    assert (await resolve(client.resume()))["status"] == "resumed"
    assert (await asyncio.wait_for(waiting, 60)).usage.completion_tokens == 3
    assert await resolve(client.is_paused()) is False
    assert (await resolve(client.sleep(level=2)))["level"] == 2
    assert await resolve(client.is_sleeping()) is True
    assert (await resolve(client.wake_up()))["status"] == "awake"
    assert await resolve(client.is_sleeping()) is False
    out = await resolve(client.completions.create(model=MODEL, prompt="hi", max_tokens=2))
    assert out.usage.completion_tokens == 2

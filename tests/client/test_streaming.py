"""Server-Sent Events: typed chunks, ``[DONE]``, and closing the connection early."""

from __future__ import annotations

import asyncio
import gc

import pytest
from iterserve_client import APIConnectionError, ChatCompletionChunk, CompletionChunk
from iterserve_client.streaming import SSEDecoder

from tests.client.stub import endless_sse_reply, raw_sse_reply, sse_reply
from tests.client.util import collect, resolve

DISCONNECT_WAIT_S = 5.0


def text_chunk(text, finish=None, index=0):
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": index, "text": text, "logprobs": None,
                         "finish_reason": finish}], "extra_field": 1}  # fmt: skip


def chat_chunk(delta, finish=None, logprobs=None):
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish}]}  # fmt: skip


def test_decoder_frames_events():
    decoder = SSEDecoder()
    lines = [": keep-alive", "event: message", "id: 3", "data: {\"a\":", "data:1}", "",
             "", "data: [DONE]", ""]  # fmt: skip
    events = [e for e in map(decoder.feed, lines) if e is not None]
    assert events == ['{"a":\n1}', "[DONE]"]
    decoder.feed("data: tail")
    assert decoder.flush() == "tail"


async def test_completion_chunks_are_typed(make_client, stub):
    usage = {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 2,
             "completion_tokens": 2, "total_tokens": 4}}  # fmt: skip
    stub.add(sse_reply([text_chunk("He"), text_chunk("llo", "length"), usage]))
    stream = await resolve(
        make_client().completions.create(
            model="m", prompt="x", stream=True, stream_options={"include_usage": True}
        )
    )
    chunks = await collect(stream)
    assert all(isinstance(c, CompletionChunk) for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello"
    assert chunks[1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 4
    assert chunks[0].raw["extra_field"] == 1
    assert stub.requests[0].body["stream"] is True
    assert stub.requests[0].body["stream_options"] == {"include_usage": True}
    assert stream.closed


async def test_chat_chunks_are_typed(make_client, stub):
    logprobs = {"content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": None}]}]}  # fmt: skip
    stub.add(sse_reply([chat_chunk({"role": "assistant", "content": ""}),
                        chat_chunk({"content": "Hi"}, logprobs=logprobs),
                        chat_chunk({}, "stop")]))  # fmt: skip
    stream = await resolve(
        make_client().chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            stream=True,
            logprobs=True,
            top_logprobs=1,
        )
    )
    chunks = await collect(stream)
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hi"
    token = chunks[1].choices[0].logprobs.content[0]
    assert (token.token, token.logprob, token.top_logprobs[0].token) == ("Hi", -0.5, "Hi")
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_done_ends_the_stream(make_client, stub):
    stub.add(raw_sse_reply('data: [DONE]\n\ndata: {"choices": []}\n\n'))
    stream = await resolve(make_client().completions.create(model="m", prompt="x", stream=True))
    assert await collect(stream) == []


async def test_crlf_framing_and_last_event_without_blank_line(make_client, stub):
    stub.add(raw_sse_reply('data: {"choices": [{"text": "a"}]}\r\n\r\ndata: [DONE]'))
    stream = await resolve(make_client().completions.create(model="m", prompt="x", stream=True))
    assert [c.choices[0].text for c in await collect(stream)] == ["a"]


async def test_stream_without_done_was_cut_short(make_client, stub):
    stub.add(sse_reply([text_chunk("a")], done=False))
    stream = await resolve(make_client().completions.create(model="m", prompt="x", stream=True))
    with pytest.raises(APIConnectionError, match=r"before data: \[DONE\]"):
        await collect(stream)


# -- leaving early closes the connection -----------------------------------------------------


async def disconnected(stub) -> bool:
    """Waits (without blocking the event loop) for the stub to see the socket closed."""
    for _ in range(int(DISCONNECT_WAIT_S / 0.01)):
        if stub.disconnected.is_set():
            return True
        await asyncio.sleep(0.01)
    return False


async def test_break_closes_the_connection(make_client, kind, stub):
    stub.add(endless_sse_reply(text_chunk("a")))
    stream = await resolve(make_client().completions.create(model="m", prompt="x", stream=True))
    if kind == "async":
        async for _ in stream:
            break
    else:
        for _ in stream:
            break
    # The stream object is still referenced: the loop alone released the connection.
    assert await disconnected(stub)
    assert stream.closed


@pytest.mark.parametrize("how", ["close", "with", "exception", "garbage"])
async def test_leaving_early_closes_the_connection(make_client, kind, stub, how):
    stub.add(endless_sse_reply(text_chunk("a")))
    stream = await resolve(make_client().completions.create(model="m", prompt="x", stream=True))
    first = await resolve(stream.__anext__() if kind == "async" else next(stream))
    assert first.choices[0].text == "a"
    if how == "close":
        await resolve(stream.close())
    elif how == "with":
        if kind == "async":
            async with stream:
                pass
        else:
            with stream:
                pass
    elif how == "exception":
        with pytest.raises(KeyError):
            if kind == "async":
                async for _ in stream:
                    raise KeyError
            else:
                for _ in stream:
                    raise KeyError
    else:
        del stream
        gc.collect()
    assert await disconnected(stub)

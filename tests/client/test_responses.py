"""``client.responses`` and ``client.embeddings``: what is sent, how answers and events
parse, errors in a stream."""

from __future__ import annotations

import pytest
from iterserve_client import NotFoundError, ResponseEvent, ServiceUnavailableError

from tests.client.stub import error_reply, json_reply, sse_reply
from tests.client.util import collect, resolve

RESPONSE = {
    "id": "resp_1", "object": "response", "created_at": 5, "status": "completed", "model": "m",
    "output": [
        {"id": "rs_1", "type": "reasoning", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Hi", "annotations": []}]},
        {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "f",
         "arguments": "{}", "status": "completed"},
    ],
    "usage": {"input_tokens": 3, "output_tokens": 5, "total_tokens": 8,
              "output_tokens_details": {"reasoning_tokens": 2}},
    "new_field": True,
}  # fmt: skip


async def test_create_sends_only_given_arguments_and_parses_the_items(make_client, stub):
    stub.add(json_reply(200, RESPONSE))
    out = await resolve(
        make_client().responses.create(model="m", input="hi", max_output_tokens=5, top_p=None)
    )
    assert stub.requests[0].body == {"model": "m", "input": "hi", "max_output_tokens": 5}
    assert [item.type for item in out.output] == ["reasoning", "message", "function_call"]
    assert out.output_text == "Hi" and out.output[0].text == "hmm"
    assert out.output[2].name == "f" and out.output[2].call_id == "call_1"
    assert out.usage.total_tokens == 8 and out.usage.reasoning_tokens == 2
    assert out.raw["new_field"] is True
    # An earlier output's items go back as input items, as they came.
    stub.add(json_reply(200, RESPONSE))
    await resolve(make_client().responses.create(model="m", input=[out.output[2]]))
    assert stub.requests[1].body["input"] == [RESPONSE["output"][2]]


async def test_retrieve_and_delete(make_client, stub):
    stub.add(json_reply(200, RESPONSE), json_reply(200, {"deleted": True}),
             error_reply(404, "Response with id 'resp_1' not found"))  # fmt: skip
    client = make_client()
    assert (await resolve(client.responses.retrieve("resp_1"))).id == "resp_1"
    await resolve(client.responses.delete("resp_1"))
    with pytest.raises(NotFoundError):
        await resolve(client.responses.retrieve("resp_1"))
    assert [(r.method, r.path) for r in stub.requests] == [
        ("GET", "/v1/responses/resp_1"),
        ("DELETE", "/v1/responses/resp_1"),
        ("GET", "/v1/responses/resp_1"),
    ]


async def test_a_stream_of_events_and_an_error_event(make_client, stub):
    events = [
        {"type": "response.created", "sequence_number": 0, "response": {**RESPONSE, "output": []}},
        {"type": "response.output_text.delta", "sequence_number": 1, "delta": "Hi",
         "output_index": 0, "item_id": "msg_1", "content_index": 0, "logprobs": []},
        {"type": "error", "sequence_number": 2, "code": "engine_unavailable",
         "message": "the engine is unavailable: lost", "param": None},
    ]  # fmt: skip
    stub.add(sse_reply(events))
    stream = await resolve(make_client().responses.create(model="m", input="hi", stream=True))
    with pytest.raises(ServiceUnavailableError, match="lost"):
        await collect(stream)
    stub.add(sse_reply(events[:2]))
    stream = await resolve(make_client().responses.create(model="m", input="hi", stream=True))
    got = await collect(stream)
    assert all(isinstance(e, ResponseEvent) for e in got)
    assert got[0].response.id == "resp_1" and got[1].delta == "Hi"


async def test_embeddings_parse_floats_and_base64_alike(make_client, stub):
    import base64
    import struct

    packed = base64.b64encode(struct.pack("<2f", 0.5, -0.25)).decode()
    body = {"object": "list", "model": "m", "usage": {"prompt_tokens": 3, "total_tokens": 3},
            "data": [{"object": "embedding", "index": 1, "embedding": packed},
                     {"object": "embedding", "index": 0, "embedding": [1.0, 0.0]}]}  # fmt: skip
    stub.add(json_reply(200, body))
    out = await resolve(
        make_client().embeddings.create(model="m", input=["a", "b"], encoding_format="base64")
    )
    assert stub.requests[0].path == "/v1/embeddings"
    assert stub.requests[0].body == {"model": "m", "input": ["a", "b"], "encoding_format": "base64"}
    assert [e.embedding for e in out.data] == [[1.0, 0.0], [0.5, -0.25]]
    assert out.usage.prompt_tokens == 3

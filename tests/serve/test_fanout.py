"""The token path from the engine to 256 streams: every token once, in order, to
its own stream, whether the client reads fast, slowly or leaves mid-stream.

The fake executor's tokens are a function of each request's label (the client's
request id and the choice index), so every stream's exact token ids are known;
the streams ask for them as ids (``return_tokens_as_token_ids``) in their
logprobs, so a lost, repeated, reordered or misdelivered token shows.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from iterserve.scheduler import FakeExecutor, SamplingParams
from tests.serve.conftest import MODEL, deploy, fake_engine, undeploy, wait_idle

APP = "fanout"
NUM_STREAMS = 256
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def fanout_url(serve_url, tokenizer_dir, vocab_size):
    config = fake_engine(
        vocab_size,
        max_num_seqs=64,
        max_num_batched_tokens=512,
        num_kv_blocks=4096,
        executor_options={"output_len": None, "step_sleep_s": 0.002},
    )
    yield deploy(serve_url, APP, model=str(tokenizer_dir), config=config)
    undeploy(APP)


def _token_ids(event: dict) -> list[int]:
    logprobs = event["choices"][0]["logprobs"] or {"tokens": []}
    return [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]


async def _stream(client, request_id: str, *, slow: bool = False, leave_after: int = 0):
    """The token ids one stream received; ``leave_after``: hang up after that many."""
    body = {
        "model": MODEL, "prompt": f"stream {request_id}", "max_tokens": MAX_TOKENS,
        "stream": True, "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    got: list[int] = []
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"X-Request-Id": request_id}) as r:  # fmt: skip
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            got += _token_ids(json.loads(line[6:]))
            if leave_after and len(got) >= leave_after:
                return got, False
            if slow:
                await asyncio.sleep(0.02)  # a reader slower than the engine's steps
    return got, True


async def test_256_streams_each_get_exactly_their_tokens_in_order(fanout_url, vocab_size):
    fake = FakeExecutor(vocab_size=vocab_size, output_len=None)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    limits = httpx.Limits(max_connections=NUM_STREAMS + 8)
    async with httpx.AsyncClient(base_url=fanout_url, timeout=120, limits=limits) as client:
        kinds = {}
        tasks = []
        for i in range(NUM_STREAMS):
            request_id = f"fan{i}"
            kind = "leaves" if i % 8 == 3 else "slow" if i % 8 == 5 else "fast"
            kinds[request_id] = kind
            leave = 1 + i % MAX_TOKENS // 2 if kind == "leaves" else 0
            tasks.append(_stream(client, request_id, slow=kind == "slow", leave_after=leave))
        results = await asyncio.gather(*tasks)
        for (request_id, kind), (got, whole) in zip(kinds.items(), results, strict=True):
            expected, _ = fake.expected_output(f"{request_id}-0", params)
            if kind == "leaves":
                assert not whole and got == expected[: len(got)], request_id
            else:
                assert whole and got == expected, request_id
        stats = await wait_idle(client)
    # A stream that left was aborted, unless its last token beat the abort there:
    # every request ended one way or the other, and nothing of any is held.
    assert stats["slots_used"] == 0 and stats["kv_blocks_used"] == 0 and stats["num_waiting"] == 0
    counters = stats["replicas"][0]["counters"]
    assert counters["finished_abort"] + counters["finished_length"] == NUM_STREAMS
    assert counters["finished_error"] == 0

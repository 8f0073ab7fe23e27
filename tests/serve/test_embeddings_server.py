"""Embeddings on the real server: a tiny Llama checkpoint served with ``runner:
pooling`` (MEAN), through the official ``openai`` client, against transformers'
hidden states; batched with other prompts in pieces by the one scheduler."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch

from iterserve.workers.tokenizer import Tokenizer
from tests.serve.conftest import (
    assert_engines_sound,
    deploy,
    tiny_model_engine,
    undeploy,
    wait_idle,
)

APP = "embed"
MODEL = "tiny-llama"
TOLERANCE = 1e-5  # of the largest magnitude, as tests/workers/test_pooling.py


@pytest.fixture(scope="module")
def url(serve_url, tiny_model_dir):
    # Prompts in pieces, several in a step.
    config = tiny_model_engine(max_num_batched_tokens=16, runner="pooling", pooling_type="MEAN")
    yield deploy(serve_url, APP, model=str(tiny_model_dir), config=config)
    undeploy(APP)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    import transformers

    model = transformers.AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = Tokenizer(tiny_model_dir)

    def embed(text: str) -> torch.Tensor:
        with torch.no_grad():
            hidden = model(torch.tensor([tok.encode(text)])).last_hidden_state[0]
        return torch.nn.functional.normalize(hidden.mean(dim=0), dim=0)

    return embed


TEXTS = [
    "hello world, this is a tiny corpus for a tiny tokenizer.",
    "the quick brown fox jumps over the lazy dog",
    "say something nice about the weather today",
]


def test_openai_embeddings_are_transformers_hidden_states_pooled(url, reference):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    out = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [e.index for e in out.data] == [0, 1, 2]
    for item, text in zip(out.data, TEXTS):
        want = reference(text)
        got = torch.tensor(item.embedding)
        assert (got - want).abs().max() <= TOLERANCE * want.abs().max(), text
    short = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=8)
    assert len(short.data[0].embedding) == 8
    assert torch.tensor(short.data[0].embedding).norm() == pytest.approx(1.0, rel=1e-5)


async def test_concurrent_requests_share_steps_and_leave_nothing_behind(url, reference):
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        bodies = [{"model": MODEL, "input": text, "encoding_format": "float"} for text in TEXTS]
        answers = await asyncio.gather(*(http.post("/v1/embeddings", json=b) for b in bodies * 3))
        for answer, text in zip(answers, TEXTS * 3):
            assert answer.status_code == 200, answer.text
            got = torch.tensor(answer.json()["data"][0]["embedding"])
            want = reference(text)
            assert (got - want).abs().max() <= TOLERANCE * want.abs().max()
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == 404 and "pooling runner" in r.json()["error"]["message"]
        stats = await wait_idle(http)
        assert stats["slots_used"] == 0 and stats["kv_blocks_used"] == 0
        assert (await http.get("/version")).json()["prefix_caching"] is False  # MEAN: off
    await assert_engines_sound(APP)

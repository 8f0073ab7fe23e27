"""POST /v1/embeddings over HTTP (no Ray), through the official ``openai`` client:
a pooling engine's vectors cut, normalised and encoded; the routes a runner does
not serve answer 404; what cannot be honoured is refused by name.

The echo engine stands in for a pooling engine: a prompt's vector is
``EchoEngine.pooled`` of its tokens.
"""

from __future__ import annotations

import base64
import math
import struct

import pytest

from iterserve.cluster.openai.embeddings import embedding_vector
from iterserve.workers.tokenizer import Tokenizer
from tests.serve.conftest import MODEL, inproc
from tests.serve.echo import EchoEngine


@pytest.fixture(scope="module")
def app(tokenizer_dir):
    return inproc(tokenizer_dir, runner="pooling")


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return Tokenizer(tokenizer_dir)


def unit(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector]


def test_the_openai_client_gets_each_inputs_vector_normalised(client, app, tok):
    texts = ["hello world", "the quick brown fox"]
    out = client.embeddings.create(model=MODEL, input=texts)  # base64, decoded by the client
    prompts = [tok.encode(text) for text in texts]
    for item, prompt in zip(out.data, prompts):
        assert item.embedding == pytest.approx(unit(EchoEngine.pooled(prompt)), rel=1e-6)
    assert [item.index for item in out.data] == [0, 1]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, prompts))
    assert all(params["max_tokens"] == 0 for _, params in app[1].opened[-2:])  # no token


def test_floats_dimensions_and_normalize(http, tok):
    body = {"model": MODEL, "input": [5, 6, 7], "encoding_format": "float", "dimensions": 2}
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["embedding"] == pytest.approx(unit([3.0, 7.0]))
    raw = http.post("/v1/embeddings", json={**body, "normalize": False}).json()
    assert raw["data"][0]["embedding"] == [3.0, 7.0]
    packed = http.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    vector = struct.unpack("<2f", base64.b64decode(packed["data"][0]["embedding"]))
    assert list(vector) == pytest.approx(unit([3.0, 7.0]), rel=1e-6)


def test_an_embedding_is_cut_before_it_is_normalised():
    assert embedding_vector([3.0, 4.0, 12.0], 2, True) == [0.6, 0.8]
    assert embedding_vector([0.0, 0.0], None, True) == [0.0, 0.0]  # nothing to divide by


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"dimensions": 5}, "dimensions"),  # the stand-in's hidden size is 4
        ({"dimensions": 0}, "dimensions"),
        ({"input": []}, "input"),
        ({"input": [10**6]}, "input"),
        ({"encoding_format": "int8"}, "encoding_format"),
        ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
        ({"input": "hello world " * 600}, "input"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(http, fields, param):
    r = http.post("/v1/embeddings", json={"model": MODEL, "input": "hi", **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_runner_serves_its_own_routes_only(http, tokenizer_dir):
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        r = http.post(path, json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "unsupported_endpoint"
        assert "pooling runner" in r.json()["error"]["message"]
    generate, _ = inproc(tokenizer_dir)
    r = generate.post("/v1/embeddings", json={"model": MODEL, "input": "hi"})
    assert r.status_code == 404 and "needs the pooling runner" in r.json()["error"]["message"]

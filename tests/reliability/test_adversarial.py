"""Hostile requests: each is refused with the right 4xx, an error body that names the
problem, and without reaching a scheduler (the engine's step and counters stay put).

Runs on a fake-executor app with an API key, max_model_len 128, max_n 16,
max_logprobs 20, a 2 MiB body limit (so the large bodies below reach validation)
and strict_fields (so unknown fields are refused rather than ignored).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.reliability.conftest import engine_marks, raw_request
from tests.serve.conftest import API_KEY, AUTH, MODEL, deploy, fake_engine, undeploy

APP = "adv"
BODY_LIMIT = 2 << 20
C, CHAT = "/v1/completions", "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def adv_url(serve_url, tokenizer_dir, vocab_size):
    config = fake_engine(vocab_size)
    yield deploy(
        serve_url,
        APP,
        model=str(tokenizer_dir),
        config=config,
        api_key=API_KEY,
        max_body_bytes=BODY_LIMIT,
        strict_fields=True,
    )
    undeploy(APP)


@pytest.fixture
def http(adv_url):
    with httpx.Client(base_url=adv_url, headers=AUTH, timeout=60) as client:
        yield client


def marks(http: httpx.Client) -> dict:
    return engine_marks(http.get("/v1/stats").json())


def body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}).encode()


def chat(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 4, **fields}).encode()


def nested(depth: int) -> bytes:
    return b'{"model": "tiny-chat", "prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"


# (id, path, body bytes, status, words the message names)
BODIES = [
    ("huge-n", C, body(n=10**9), 400, ["n", "[1, 16]"]),
    ("n-2^70", C, body(n=2**70), 400, ["n", "[1, 16]"]),
    ("max-tokens-past-context", C, body(max_tokens=10**6), 400, ["context length is 128"]),
    ("max-tokens-2^40", C, body(max_tokens=2**40), 400, ["max_tokens", "1073741824"]),
    ("temperature-NaN", C, body()[:-1] + b', "temperature": NaN}', 400, ["temperature", "nan"]),
    ("temperature-Infinity", C, body()[:-1] + b', "temperature": Infinity}', 400, ["inf"]),
    ("top-p-minus-Infinity", C, body()[:-1] + b', "top_p": -Infinity}', 400, ["top_p", "inf"]),
    ("temperature-'NaN'", C, body(temperature="NaN"), 400, ["temperature", "valid number"]),
    ("temperature-'Infinity'", C, body(temperature="Infinity"), 400, ["temperature"]),
    ("10000-stop-strings", C, body(stop=["x"] * 10000), 400, ["stop", "at most 16", "10000"]),
    ("stop-string-10000-chars", C, body(stop="x" * 10000), 400, ["stop", "1 to 128"]),
    ("100k-token-prompt", C, body(prompt=[5] * 100_000), 400, ["100000 in the prompt"]),
    ("100k-prompts", C, body(prompt=["a"] * 100_000), 400, ["at most 64 prompts", "100000"]),
    ("deep-array", C, b"[" * 100_000, 400, ["not valid JSON"]),
    ("deep-in-field", C, nested(100_000), 400, ["not valid JSON"]),
    ("deep-object", C, b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, 400, ["not valid JSON"]),
    ("nested-prompt-parses", C, nested(500), 400, ["prompt: must be a string"]),
    ("invalid-utf8", C, b'{"model": "tiny-chat", "prompt": "\xff\xfe"}', 400, ["not valid JSON"]),
    ("overlong-utf8", C, b'{"model": "tiny-chat", "prompt": "\xc0\xaf"}', 400, ["not valid JSON"]),
    ("lone-surrogate", C, body(prompt="\ud800"), 400, ["prompt", "surrogate"]),
    ("empty-prompt-list", C, body(prompt=[]), 400, ["prompt: must not be empty"]),
    ("empty-token-list", C, body(prompt=[[]]), 400, ["prompt: must not be empty"]),
    ("empty-messages", CHAT, chat(messages=[]), 400, ["messages: must not be empty"]),
    ("unknown-fields", C, body(evil=1, admin=True), 400, ["unknown field(s): evil, admin"]),
    ("unknown-nested", CHAT, chat(messages=[{**MSGS[0], "x": 1}]), 400, ["messages.0.x"]),
    ("max-tokens-string", C, body(max_tokens="10"), 400, ["max_tokens", "valid integer"]),
    ("max-tokens-fraction", C, body(max_tokens=4.5), 400, ["max_tokens", "valid integer"]),
    ("n-true", C, body(n=True), 400, ["n", "valid integer"]),
    ("stream-yes", C, body(stream="yes"), 400, ["stream", "valid boolean"]),
    ("prompt-object", C, body(prompt={"a": 1}), 400, ["prompt: must be a string"]),
    ("messages-string", CHAT, chat(messages="hi"), 400, ["messages"]),
    ("max-tokens-0", C, body(max_tokens=0), 400, ["max_tokens", "got 0", "echo"]),
    ("max-tokens-negative", C, body(max_tokens=-1), 400, ["max_tokens", "got -1"]),
    ("n-0", C, body(n=0), 400, ["n", "got 0"]),
    ("top-k-negative", C, body(top_k=-2), 400, ["top_k", "got -2"]),
    ("temperature-negative", C, body(temperature=-0.5), 400, ["temperature", "-0.5"]),
    ("seed-negative", C, body(seed=-1), 400, ["seed", "got -1"]),
    ("logprobs-negative", C, body(logprobs=-1), 400, ["logprobs", "got -1"]),
    ("top-p-0", C, body(top_p=0), 400, ["top_p", "(0.0, 1.0]"]),
    ("priority-2^31", C, body(priority=2**31), 400, ["priority", "2147483647"]),
    ("logprobs-over-cap", C, body(logprobs=21), 400, ["logprobs", "[0, 20]", "21"]),
    ("top-logprobs-over-cap", CHAT, chat(logprobs=True, top_logprobs=10**6), 400, ["[0, 20]"]),
    ("min-tokens-over-max", C, body(min_tokens=9, max_tokens=3), 400, ["min_tokens", "[0, 3]"]),
    ("stop-token-id-past-vocab", C, body(stop_token_ids=[10**9]), 400, ["stop_token_ids"]),
    ("10000-stop-token-ids", C, body(stop_token_ids=[5] * 10000), 400, ["at most 256"]),
    ("negative-token-id", C, body(prompt=[-1]), 400, ["token ids must be in [0,"]),
    ("huge-int-literal", C, body()[:-1] + b', "seed": ' + b"9" * 5000 + b"}", 400, ["JSON"]),
    ("logit-bias-key", C, body(logit_bias={"a5": 1}), 400, ["logit_bias", "token ids"]),
    ("logit-bias-past-vocab", C, body(logit_bias={"9" * 10: 1}), 400, ["logit_bias", "[0,"]),
    ("logit-bias-1e9", C, body(logit_bias={"5": 1e9}), 400, ["logit_bias", "[-100.0, 100.0]"]),
    ("bad-regex", C, body(guided_regex="(" * 5000), 400, ["guided_regex", "does not compile"]),
    ("bad-schema", CHAT, chat(guided_json={"type": 5}), 400, ["guided_json", "does not compile"]),
    ("grammar-nul", C, body(guided_regex="a\u0000"), 400, ["guided_regex", "NUL"]),
    ("chat-template", CHAT, chat(chat_template="{{ 7*7 }}"), 400, ["chat_template"]),
    ("json-array", C, b"[]", 400, ["must be a JSON object"]),
    ("json-string", C, b'"hi"', 400, ["must be a JSON object"]),
    ("json-null", C, b"null", 400, ["must be a JSON object"]),
    ("empty-body", C, b"", 400, ["not valid JSON"]),
    ("unknown-model", C, body(model="gpt-4"), 404, ["gpt-4", "does not exist"]),
    ("unknown-model-chat", CHAT, chat(model="../../etc/passwd"), 404, ["does not exist"]),
]


def assert_error(r, status: int, words) -> dict:
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code", "request_id"}, error
    for word in words:
        assert word in error["message"], (word, error["message"][:300])
    return error


@pytest.mark.parametrize(
    "path, content, status, words", [b[1:] for b in BODIES], ids=[b[0] for b in BODIES]
)
def test_hostile_bodies_are_refused_before_the_scheduler(http, path, content, status, words):
    before = marks(http)
    assert_error(http.post(path, content=content, headers=JSON), status, words)
    assert marks(http) == before


HEADERS = [  # (id, extra header lines, status)
    ("no-key", [], 401),
    ("basic-scheme", [f"Authorization: Basic {API_KEY}"], 401),
    ("wrong-key", ["Authorization: Bearer not-the-key"], 401),
    ("key-prefix", [f"Authorization: Bearer {API_KEY[:-1]}"], 401),
    ("key-plus-junk", [f"Authorization: Bearer {API_KEY} extra"], 401),
    ("no-space", [f"Authorization: Bearer{API_KEY}"], 401),
    ("empty-bearer", ["Authorization: Bearer "], 401),
    ("two-headers-good-first", [f"Authorization: Bearer {API_KEY}", "Authorization: Bearer x"], 401),
    ("two-headers-good-last", ["Authorization: Bearer x", f"Authorization: Bearer {API_KEY}"], 401),
    ("very-long-header", ["Authorization: Bearer " + "k" * 100_000], 401),
    ("content-type-text", [f"Authorization: Bearer {API_KEY}", "Content-Type: text/plain"], 415),
    ("content-type-form", [f"Authorization: Bearer {API_KEY}",
                           "Content-Type: application/x-www-form-urlencoded"], 415),
    ("content-type-lookalike", [f"Authorization: Bearer {API_KEY}",
                                "Content-Type: application/jsonp"], 415),
]  # fmt: skip
PATHS = [  # (id, request line, status)
    ("trailing-slash", "POST {prefix}/v1/completions/", 404),
    ("double-slash", "POST {prefix}//v1/completions", 404),
    ("dot-dot", "POST {prefix}/v1/../v1/completions", 404),
    ("encoded-dot-dot", "POST {prefix}/v1/%2e%2e/v1/completions", 404),
    ("encoded-nul", "POST {prefix}/v1/completions%00", 404),
    ("upper-case", "POST {prefix}/V1/completions", 404),
    ("wrong-method", "GET {prefix}/v1/completions", 405),
    ("put", "PUT {prefix}/v1/completions", 405),
]
AUTH_LINE = f"Authorization: Bearer {API_KEY}"
RAW_CASES = [(i, f"POST {{prefix}}{C}", lines, s) for i, lines, s in HEADERS]
RAW_CASES += [(i, line, [AUTH_LINE], s) for i, line, s in PATHS]


@pytest.mark.parametrize(
    "line, headers, status", [c[1:] for c in RAW_CASES], ids=[c[0] for c in RAW_CASES]
)
def test_header_and_path_tricks_are_refused_before_the_scheduler(
    http, adv_url, line, headers, status
):
    before = marks(http)
    if not any(h.lower().startswith("content-type") for h in headers):
        headers = [*headers, "Content-Type: application/json"]
    head = "\r\n".join([f"{line} HTTP/1.1", *headers]).encode("latin-1")
    r = raw_request(adv_url, head, body())
    assert r.status == status, r.body[:300]
    error = r.json()["error"]
    words = {401: "API key", 404: "no route", 405: "not allowed", 415: "Content-Type"}
    assert words[status] in error["message"], error
    assert marks(http) == before


@pytest.mark.parametrize(
    "header",
    [f"Authorization: Bearer {API_KEY}\n", f"Authorization: Bearer {API_KEY}\x00"],
    ids=["key-with-newline", "key-with-nul"],
)
def test_malformed_header_lines_are_refused_by_the_http_parser(http, adv_url, header):
    """A bare LF or a NUL inside a header line never reaches the app: the HTTP
    parser answers 400 itself (its own plain-text body)."""
    before = marks(http)
    head = f"POST {{prefix}}{C} HTTP/1.1\r\n{header}\r\nContent-Type: application/json"
    r = raw_request(adv_url, head.encode("latin-1"), body())
    assert r.status == 400, r.body[:300]
    assert marks(http) == before


def test_a_100_mb_body_is_refused_while_it_streams(http, adv_url):
    """Declared (Content-Length) or not (chunked), 100 MB are answered 413 long
    before they could be read; the client streams from a generator, never
    holding the body."""
    before = marks(http)
    total = 100 << 20

    def pieces():
        yield b'{"model": "tiny-chat", "prompt": "'
        for _ in range(total >> 16):
            yield b"x" * (1 << 16)
        yield b'"}'

    started = time.monotonic()
    r = http.post(C, content=pieces(), headers=JSON)  # chunked: no Content-Length
    assert_error(r, 413, [f"max_body_bytes={BODY_LIMIT}"])
    head = f"POST {{prefix}}{C} HTTP/1.1\r\n{AUTH_LINE}\r\nContent-Length: {total + 40}".encode()
    r = raw_request(adv_url, head, b'{"model": "tiny-chat", "prompt": "' + b"x" * (1 << 16))
    assert r.status == 413 and "max_body_bytes" in r.json()["error"]["message"]
    print(f"\n100 MB bodies refused in {time.monotonic() - started:.2f} s")
    assert marks(http) == before


@pytest.mark.parametrize(
    "line, headers",
    [
        (f"POST {{prefix}}{C}", ["Authorization: bearer " + API_KEY]),  # schemes ignore case
        (f"POST {{prefix}}{C}", ["Authorization: Bearer  " + API_KEY]),  # 1*SP before the token
        ("POST {prefix}/v1/%63ompletions", [AUTH_LINE]),  # %63 is "c": the same path
    ],
    ids=["lower-case-scheme", "two-spaces", "percent-encoded-letter"],
)
def test_spellings_the_rfcs_call_equal_are_served(adv_url, line, headers):
    head = "\r\n".join([f"{line} HTTP/1.1", *headers, "Content-Type: application/json"])
    r = raw_request(adv_url, head.encode(), body())
    assert r.status == 200, r.body[:300]
    # ... and the same spelling without the key is still refused.
    bare = "\r\n".join([f"{line} HTTP/1.1", "Content-Type: application/json"]).encode()
    assert raw_request(adv_url, bare, body()).status == 401


def test_a_seed_at_the_top_of_its_range_works_with_every_n(http):
    r = http.post(C, content=body(seed=2**63 - 1, n=3), headers=JSON)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3

"""Structured outputs and the engine-side extensions on the real server with the
demo model: every constrained answer follows its grammar, on an engine small
enough that constrained sequences are preempted and recomputed, and no request,
good or bad, leaves a slot or a KV block behind."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from iterserve.models import DEMO_MODEL_PATH
from iterserve.workers.tokenizer import Tokenizer
from tests.serve.conftest import assert_engines_sound, deploy, undeploy, wait_idle

APP = "structured"
MODEL = "demo"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ASK = [{"role": "user", "content": "Describe a Python release as JSON."}]


@pytest.fixture(scope="module")
def url(serve_url):
    config = dict(
        dtype="float32",
        kernel_backend="torch",
        max_model_len=512,
        max_num_seqs=32,
        max_num_batched_tokens=512,
        block_size=4,
        # 640 tokens of KV for 32 sequences of ~100: constrained ones are preempted
        # and recomputed, their matchers rebuilt from the tokens they carry.
        num_kv_blocks=160,
        num_cpus_per_worker=0.1,
        torch_threads=1,
    )
    yield deploy(serve_url, APP, model=str(DEMO_MODEL_PATH), config=config)
    undeploy(APP)


@pytest.fixture
async def http(url):
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        yield client


def leaf(kind: str, i: int) -> dict:
    if kind == "int":
        lo = (i * 7) % 50
        return {"type": "integer", "minimum": lo, "maximum": lo + 10 + i % 90}
    if kind == "num":
        return {"type": "number", "minimum": -5 - i % 3, "maximum": 5 + i % 20}
    if kind == "str":
        return {"type": "string", "maxLength": 4 + i % 12}
    if kind == "enum":
        return {
            "enum": [["red", "green", "blue"], ["py", "go"], ["a", "b", "c", "d"], [1, 2, 3]][i % 4]
        }
    return {"type": "boolean"}


KINDS = ["int", "num", "str", "enum", "bool"]


def schema(i: int) -> dict:
    """Schema ``i`` of a family: 1-4 leaves of every kind (bounded numbers, short
    strings, enums, booleans), then an array, a nested object with an optional
    field, an array of objects or two levels of objects; every third field optional."""
    props = {f"f{k}": leaf(KINDS[(i + k) % 5], i + k) for k in range(1 + i % 4)}
    shape = i % 5
    if shape == 1:
        props["items"] = {"type": "array", "items": leaf(KINDS[i % 5], i), "minItems": 1,
                          "maxItems": 1 + i % 3}  # fmt: skip
    elif shape == 2:
        props["inner"] = {"type": "object", "required": ["x"],
                          "properties": {"x": leaf("int", i), "y": leaf("str", i)}}  # fmt: skip
    elif shape == 3:
        row = {"type": "object", "properties": {"k": leaf("enum", i), "v": leaf("bool", i)},
               "required": ["k", "v"]}  # fmt: skip
        props["rows"] = {"type": "array", "items": row, "maxItems": 2}
    elif shape == 4:
        deep = {"type": "object", "properties": {"c": leaf("num", i)}, "required": ["c"]}
        props["a"] = {"type": "object", "properties": {"b": deep}, "required": ["b"]}
    required = [name for j, name in enumerate(props) if j % 3 != 2]
    return {"type": "object", "properties": props, "required": required}


SCHEMAS = [schema(i) for i in range(60)]


async def test_every_json_schema_answer_parses_and_validates(http):
    async def one(i: int) -> tuple[str, str]:
        form = {"type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}}  # fmt: skip
        body = {"model": MODEL, "messages": ASK, "response_format": form, "max_tokens": 160,
                "temperature": 1.0, "seed": i}  # fmt: skip
        r = await http.post(CHAT, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]

    answers = await asyncio.gather(*(one(i) for i in range(len(SCHEMAS))))
    for i, (text, reason) in enumerate(answers):
        assert reason == "stop", (i, text)
        jsonschema.validate(json.loads(text), SCHEMAS[i])
    stats = (await http.get("/v1/stats")).json()
    assert stats["num_preemptions"] > 0, "the engine was meant to preempt constrained sequences"


@pytest.mark.parametrize(
    "fields, check, temperature",
    [
        ({"guided_regex": r"(yes|no), because [a-z ]{3,30}\."},
         lambda t: re.fullmatch(r"(yes|no), because [a-z ]{3,30}\.", t), 1.0),
        ({"guided_choice": ["list", "tuple", 'a "dict"']},
         lambda t: t in ("list", "tuple", 'a "dict"'), 1.0),
        ({"guided_grammar": 'root ::= "x = " [0-9]{1,4} ";"'},
         lambda t: re.fullmatch(r"x = [0-9]{1,4};", t), 1.0),
        ({"structured_outputs": {"json": {"type": "array", "items": {"type": "integer",
                                 "maximum": 999}, "maxItems": 4}}},
         lambda t: all(isinstance(v, int) for v in json.loads(t)), 1.0),
        # Any object: its keys and strings are unbounded, and sampled freely the
        # demo model may write one past max_tokens; greedily it closes them.
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict),
         0.0),
    ],
)  # fmt: skip
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_every_way_of_constraining_the_output_is_followed(
    http, path, fields, check, temperature
):
    base = {"messages": ASK} if path == CHAT else {"prompt": "The answer:"}
    bodies = [{"model": MODEL, **base, **fields, "max_tokens": 120, "temperature": temperature,
               "seed": seed} for seed in range(4)]  # fmt: skip
    replies = await asyncio.gather(*(http.post(path, json=b) for b in bodies))
    for r in replies:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if path == CHAT else choice["text"]
        assert choice["finish_reason"] == "stop" and check(text), text


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_tool_choice_required_and_named_always_make_valid_calls(client):
    # One call per answer (parallel_tool_calls false): a list of calls is unbounded,
    # and sampled freely the model may write calls past max_tokens.
    for seed in range(3):
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            reply = client.chat.completions.create(
                model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                max_tokens=120, temperature=1.0, seed=seed, parallel_tool_calls=False,
            )  # fmt: skip
            message = reply.choices[0].message
            assert reply.choices[0].finish_reason == "tool_calls" and message.tool_calls
            for call in message.tool_calls:
                arguments = json.loads(call.function.arguments)
                if call.function.name == "get_weather":
                    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
                else:
                    assert call.function.name == "get_time" and arguments == {}


def test_openai_parse_fills_a_pydantic_model(client):
    class Release(BaseModel):
        version: str = Field(max_length=12)
        year: int = Field(ge=1991, le=2030)
        stable: bool

    for seed in range(3):
        parsed = client.chat.completions.parse(
            model=MODEL, messages=ASK, response_format=Release, max_tokens=120, seed=seed
        )
        release = parsed.choices[0].message.parsed
        assert isinstance(release, Release) and 1991 <= release.year <= 2030


def test_echo_returns_the_prompts_logprobs_from_the_model(client):
    tok = Tokenizer(DEMO_MODEL_PATH)
    prompt = "A list is a mutable sequence"
    ids = tok.encode(prompt)
    reply = client.completions.create(
        model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=0,
        extra_body={"prompt_logprobs": 2},
    )  # fmt: skip
    (choice,) = reply.choices
    assert choice.text == prompt and choice.finish_reason == "length"
    logprobs = choice.logprobs.token_logprobs
    assert len(logprobs) == len(ids) and logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in logprobs[1:])
    vllm_shape = choice.model_extra["prompt_logprobs"]
    for i, token_id in enumerate(ids[1:], start=1):
        assert vllm_shape[i][str(token_id)]["logprob"] == pytest.approx(logprobs[i])
    # The same prompt continued: its prompt logprobs do not change with max_tokens.
    more = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2,
                                     max_tokens=5, temperature=0)  # fmt: skip
    assert more.choices[0].logprobs.token_logprobs[: len(ids)] == pytest.approx(logprobs)
    assert more.choices[0].text.startswith(prompt) and more.usage.completion_tokens == 5


def test_logit_bias_allowed_tokens_and_bad_words_steer_the_model(client):
    tok = Tokenizer(DEMO_MODEL_PATH)
    word = tok.encode(" Python", add_special_tokens=False)
    free = client.completions.create(model=MODEL, prompt="The language is", max_tokens=8,
                                     temperature=0)  # fmt: skip
    biased = client.completions.create(
        model=MODEL, prompt="The language is", max_tokens=3, temperature=0,
        logit_bias={str(word[0]): 100},
    )  # fmt: skip
    assert biased.choices[0].text.startswith(tok.decode(word[:1]))
    allowed = sorted({tok.encode(w, add_special_tokens=False)[0] for w in (" yes", " no", " is")})
    only = client.completions.create(
        model=MODEL, prompt="Is it?", max_tokens=6, temperature=1.0, seed=1, logprobs=0,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True,
                    "return_tokens_as_token_ids": True},
    )  # fmt: skip
    drawn = [int(t.removeprefix("token_id:")) for t in only.choices[0].logprobs.tokens]
    assert len(drawn) == 6 and set(drawn) <= set(allowed)
    first = free.choices[0].text.split()[0]
    banned = client.completions.create(
        model=MODEL, prompt="The language is", max_tokens=8, temperature=0,
        extra_body={"bad_words": [first]},
    )  # fmt: skip
    assert first not in banned.choices[0].text.split()


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
         400, "does not compile"),
        ({"guided_regex": "a{"}, 400, "does not compile"),
        ({"guided_json": {"type": "object"}, "ignore_eos": True}, 400, "ignore_eos"),
        ({"logit_bias": {"4096": 1}}, 400, "logit_bias"),
        ({"prompt_logprobs": 99}, 400, "prompt_logprobs"),
        ({"guided_choice": []}, 400, "guided_choice"),
        ({"no_such_field": 1, "guided_choice": ["a", "b"]}, 200, None),
    ],
)  # fmt: skip
async def test_bad_requests_are_refused_and_good_ones_served(http, body, status, words):
    r = await http.post(CHAT, json={"model": MODEL, "messages": ASK, "max_tokens": 20, **body})
    assert r.status_code == status, r.text
    if words:
        assert words in r.json()["error"]["message"]


async def test_nothing_is_left_behind(http):
    stats = await wait_idle(http, timeout_s=60)
    assert stats["slots_used"] == 0 and stats["kv_blocks_used"] == 0, stats
    assert (await http.get("/health")).status_code == 200
    await assert_engines_sound(APP)

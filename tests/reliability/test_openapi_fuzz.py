"""schemathesis against the live server's own OpenAPI schema (GET /openapi.json).

Positive cases (bodies the schema accepts) must be served (2xx); negative cases
(bodies that break it) must be refused with a 4xx; nothing may be a 5xx, and the
server must be healthy and hold no slot and no KV block afterwards.

Positive cases are adjusted for the rules JSON Schema cannot state, which the
schema lists in its description (``CROSS_FIELD_RULES``): the prompt plus
``max_tokens`` must fit the context, ``min_tokens <= max_tokens``, and so on. A
prompt that alone fills the context is then the one expected refusal (400,
``context_length_exceeded``).
"""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from iterserve.cluster.openai.chat import render_prompt
from iterserve.cluster.openai.protocol import ChatCompletionRequest
from iterserve.cluster.openai.responses.items import chat_body, own_items
from iterserve.cluster.openai.responses.protocol import ResponsesRequest
from iterserve.cluster.openai.serving import load_json
from iterserve.workers.tokenizer import Tokenizer
from tests.reliability.conftest import idle_replicas
from tests.serve.conftest import API_KEY, AUTH, assert_engines_sound, deploy, fake_engine, undeploy

APP = "fuzz"
POOLING_APP = "fuzz-pooling"
MAX_MODEL_LEN = 128  # short: every generation is at most 127 steps
EXAMPLES = 200
SEEN: Counter = Counter()  # (mode, operation, status) -> responses


@pytest.fixture(scope="module")
def fuzz_url(serve_url, tokenizer_dir, vocab_size):
    config = fake_engine(
        vocab_size,
        max_n=2,
        max_num_seqs=32,
        num_kv_blocks=1024,
        executor_options={"max_model_len": MAX_MODEL_LEN},
    )
    app = dict(model=str(tokenizer_dir), config=config, api_key=API_KEY, tool_call_parser="hermes")
    yield deploy(serve_url, APP, **app)
    undeploy(APP)


@pytest.fixture(scope="module")
def pooling_url(serve_url, tokenizer_dir, vocab_size):
    """The same model served for embeddings (the fake executor's vectors)."""
    config = fake_engine(
        vocab_size,
        runner="pooling",
        max_num_seqs=32,
        num_kv_blocks=1024,
        executor_options={"max_model_len": MAX_MODEL_LEN},
    )
    yield deploy(serve_url, POOLING_APP, model=str(tokenizer_dir), config=config, api_key=API_KEY)
    undeploy(POOLING_APP)


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return Tokenizer(tokenizer_dir)


def prompt_lens(body: dict, chat: bool, tok: Tokenizer) -> list[int]:
    if chat:  # rendered as the server renders it, template options included
        request = ChatCompletionRequest.model_validate(load_json(json.dumps(body).encode()))
        text = render_prompt(tok, request)
        return [len(tok.encode(text, body.get("add_special_tokens", False)))]
    prompt = body["prompt"]
    # Token ids may be integral floats (42.0): JSON Schema and the server take them.
    flat = isinstance(prompt, str) or isinstance(prompt[0], (int, float))
    prompts = [prompt] if flat else prompt
    special = body.get("add_special_tokens", True)
    return [len(tok.encode(p, special)) if isinstance(p, str) else len(p) for p in prompts]


def _json_object_text(text) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (TypeError, ValueError):
        return False


def fit_chat_rules(body: dict) -> None:
    """The chat-only rules: tool_choice needs tools, continue_final_message excludes
    add_generation_prompt, content is null only beside tool calls, whose
    arguments are JSON objects."""
    if not body.get("tools") and body.get("tool_choice") not in (None, "none"):
        body["tool_choice"] = None
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        body["add_generation_prompt"] = None
    for message in body["messages"]:
        calls = message.get("tool_calls") or []
        if message.get("content") is None and not calls:
            message["content"] = ""
        for call in calls:
            arguments = call["function"]["arguments"]
            if isinstance(arguments, str) and not _json_object_text(arguments):
                call["function"]["arguments"] = "{}"


GRAMMAR_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
GRAMMAR_CLASHES = {"ignore_eos": False, "min_tokens": None, "allowed_token_ids": None}


def fit_structured_rules(body: dict, chat: bool, tok: Tokenizer) -> None:
    """The rules of structured outputs and the engine-side fields: a grammar must
    compile (a random schema, regex or grammar rarely does, so positive cases keep
    only json_object and the tool_choice grammars, over tools whose parameters are
    any object), one way at a time, without the fields it excludes; logit_bias keys
    are in the vocabulary; max_tokens 0 only with echo."""
    for name in (*GRAMMAR_FIELDS, "structured_outputs"):
        body.pop(name, None)
    form = body.get("response_format")
    structured = isinstance(form, dict) and form.get("type") == "json_object"
    if isinstance(form, dict) and form.get("type") == "json_schema":
        body["response_format"] = None
    choice = body.get("tool_choice") if chat else None
    if choice == "required" or isinstance(choice, dict):
        body["response_format"] = None
        for tool in body["tools"]:
            tool["function"]["parameters"] = None
        if isinstance(choice, dict):
            choice["function"]["name"] = body["tools"][0]["function"]["name"]
        structured = True
    if structured:
        body.update(GRAMMAR_CLASHES, bad_words=None)
    if body.get("logit_bias"):
        body["logit_bias"] = {
            k: v for k, v in body["logit_bias"].items() if int(k) < tok.vocab_size
        }
    if not chat and not body.get("echo"):
        for key in ("max_tokens", "max_completion_tokens"):
            if body.get(key) == 0:
                body[key] = 1


def fit_cross_field_rules(body: dict, chat: bool, tok: Tokenizer) -> bool:
    """Adjusts a schema-valid body to the rules across fields; False when its
    prompt alone fills the context (the server must then refuse it)."""
    if body.get("stream_options") is not None and not body.get("stream"):
        body["stream_options"] = None
    if chat and body.get("top_logprobs") is not None:
        body["logprobs"] = True
    if not chat and body.get("best_of") is not None:
        body["best_of"] = body.get("n", 1)
    if chat:
        fit_chat_rules(body)
    elif body.get("add_special_tokens") is False and 0 in prompt_lens(body, chat, tok):
        body["add_special_tokens"] = True  # an empty text prompt has no token without BOS
    fit_structured_rules(body, chat, tok)
    room = MAX_MODEL_LEN - max(prompt_lens(body, chat, tok))
    if room < 1:
        return False
    key = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
    if body.get(key) is not None:
        body[key] = min(body[key], room)
    if body.get("min_tokens") is not None:
        limit = room if body.get(key) is None else body[key]
        body["min_tokens"] = min(body["min_tokens"], limit)
    return True


def fit_responses_rules(body: dict, tok: Tokenizer) -> bool:
    """The Responses API's rules (RESPONSES_RULES): no stored response to continue,
    no tool message (this template knows none), calls' arguments JSON objects,
    tool_choice as chat's, no random json_schema; False when the input alone
    fills the context."""
    body["previous_response_id"] = None
    if isinstance(body["input"], list):
        items = [i for i in body["input"] if i.get("type") != "function_call_output"]
        for item in items:
            if item.get("type") == "function_call" and not _json_object_text(item["arguments"]):
                item["arguments"] = "{}"
        # An empty list is refused ("input: must not be empty"); reasoning alone
        # says nothing unless instructions do.
        said = [i for i in items if i.get("type") != "reasoning"] or body.get("instructions")
        body["input"] = items if items and said else "hello"
    tools, choice = body.get("tools") or [], body.get("tool_choice")
    if not tools and choice not in (None, "none"):
        body["tool_choice"] = choice = None
    text = body.get("text") or {}
    if (text.get("format") or {}).get("type") == "json_schema":
        text["format"] = None
    if choice == "required" or isinstance(choice, dict):
        text["format"] = None
        for tool in tools:
            tool["parameters"] = None
        if isinstance(choice, dict):
            choice["name"] = tools[0]["name"]
    request = ResponsesRequest.model_validate(load_json(json.dumps(body).encode()))
    chat = ChatCompletionRequest.model_validate(chat_body(request, [], own_items(request), "m"))
    room = MAX_MODEL_LEN - len(tok.encode(render_prompt(tok, chat), False))
    if room < 1:
        return False
    if body.get("max_output_tokens") is not None:
        body["max_output_tokens"] = min(body["max_output_tokens"], room)
    return True


def fit_embedding_rules(body: dict, tok: Tokenizer) -> bool:
    """An embedding's rules: an input is not empty; False when one alone fills
    the context (the server must then refuse it)."""
    as_prompt = {
        "prompt": body["input"],
        "add_special_tokens": body.get("add_special_tokens", True),
    }
    if as_prompt["add_special_tokens"] is False and 0 in prompt_lens(as_prompt, False, tok):
        body["add_special_tokens"] = as_prompt["add_special_tokens"] = True
    return max(prompt_lens(as_prompt, False, tok)) < MAX_MODEL_LEN


WITH_INPUT = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]
WITH_INPUT.append(("POST", "/v1/responses"))
WITH_INPUT.append(("GET", "/v1/models/{model_id}"))
WITHOUT_INPUT = [
    ("GET", "/v1/models"),
    ("GET", "/v1/stats"),
    ("GET", "/health"),
    ("GET", "/metrics"),
]
# Operations without input have one positive case and nothing to break.
CASES = [("positive", *op) for op in WITH_INPUT + WITHOUT_INPUT]
CASES += [("negative", *op) for op in WITH_INPUT]
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def check_positive(case, tok: Tokenizer) -> int:
    expect_context_refusal = False
    responses = case.operation.path == "/v1/responses"
    if responses:
        expect_context_refusal = not fit_responses_rules(case.body, tok)
    elif case.operation.path == "/v1/embeddings":
        expect_context_refusal = not fit_embedding_rules(case.body, tok)
    elif case.operation.method == "post":
        chat = case.operation.path.endswith("chat/completions")
        expect_context_refusal = not fit_cross_field_rules(case.body, chat, tok)
    response = case.call(headers=AUTH, timeout=60)
    detail = f"{case.body!r:.2000} -> {response.status_code} {response.text[:500]}"
    if expect_context_refusal:
        assert response.status_code == 400, detail
        assert response.json()["error"]["code"] == "context_length_exceeded", detail
    else:
        assert response.status_code == 200, detail
    if response.status_code == 200 and isinstance(case.body, dict) and case.body.get("stream"):
        events = response.content.split(b"\n\n")  # SSE events; bytes: text may hold U+0085
        assert events[-2:] == [b"data: [DONE]", b""], f"{detail} ... {response.content[-800:]}"
        if responses:  # typed events: the last one completes the response
            ends = (b"event: response.completed", b"event: response.incomplete")
            assert events[-3].startswith(ends), detail
        else:
            assert b'"error"' not in events[-3], detail
    return response.status_code


def check_negative(case) -> int:
    response = case.call(headers=AUTH, timeout=60)
    detail = f"{case.body!r:.2000} -> {response.status_code} {response.text[:500]}"
    assert 400 <= response.status_code < 500, detail
    error = response.json()["error"]
    assert error["message"] and error["type"], detail
    return response.status_code


@pytest.mark.parametrize("mode, method, path", CASES, ids=[" ".join(c) for c in CASES])
def test_schema_cases_are_served_or_refused_by_the_rules(fuzz_url, tok, mode, method, path):
    assert fuzz_operation(fuzz_url, tok, mode, method, path) > 0


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_embedding_cases_are_served_or_refused_by_the_rules(pooling_url, tok, mode):
    assert fuzz_operation(pooling_url, tok, mode, "POST", "/v1/embeddings") > 0


def fuzz_operation(url: str, tok: Tokenizer, mode: str, method: str, path: str) -> int:
    """Sends the operation's drawn cases, each checked by the rules as it is answered
    (:func:`check_positive`, :func:`check_negative`); returns how many were sent."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=AUTH, timeout=60)
    schema.config.update(base_url=url)
    schema.config.max_stream_events = 1 << 20  # read every stream to its end
    # The key is sent by the test; random Authorization headers would only test 401.
    schema.config.generation.update(with_security_parameters=False)
    operation = schema[path][method]

    @FUZZ
    @given(operation.as_strategy(generation_mode=GenerationMode(mode)))
    def fuzz(case):
        status = check_positive(case, tok) if mode == "positive" else check_negative(case)
        SEEN[mode, f"{method} {path}", status] += 1

    before = sum(n for (m, o, _), n in SEEN.items() if (m, o) == (mode, f"{method} {path}"))
    fuzz()
    return sum(n for (m, o, _), n in SEEN.items() if (m, o) == (mode, f"{method} {path}")) - before


async def test_fuzzing_left_the_servers_healthy_and_idle(fuzz_url, pooling_url):
    print("\nresponses per (mode, operation, status):")
    for key, count in sorted(SEEN.items()):
        print(f"  {key}: {count}")
    assert not any(status >= 500 for _, _, status in SEEN)
    for mode in ("positive", "negative"):
        operations = ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses",
                      "POST /v1/embeddings")  # fmt: skip
        for op in operations:
            runs = sum(n for (m, o, _), n in SEEN.items() if (m, o) == (mode, op))
            assert runs >= EXAMPLES, (mode, op, runs)
    for url, app in ((fuzz_url, APP), (pooling_url, POOLING_APP)):
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as client:
            assert (await client.get("/health")).status_code == 200
            for replica in await idle_replicas(client):
                assert replica["slots_used"] == 0 and replica["kv_blocks_used"] == 0, replica
        await assert_engines_sound(app)

"""A model stand-in that answers with the text of the last user message.

Tests of tool calling need output they choose: the user writes the reply
(``<tool_call>{...}</tool_call>``, a Llama-style JSON call, plain text) and the
stand-in "generates" exactly those tokens, then EOS. It exists twice over: as a
stand-in model for the real server (:class:`Echo`, handed to ``build_app`` in
code) and as an in-process :class:`EchoEngine` for the HTTP layer without Ray.

The tokenizer (:func:`build_tools_tokenizer`) marks turns with special tokens
(``<|user|>`` ... ``<|end|>``), so the tokens of a message's content are exactly
those of its text, and its chat template renders tools, tool calls and tool
results the way Hermes-style templates do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from iterserve.cluster.engine.connection import engine_request
from iterserve.scheduler import SamplingParams
from iterserve.scheduler.fake_executor import FakeExecutor, FakeModel
from iterserve.scheduler.messages import EngineOutput, PromptLogprobs
from iterserve.scheduler.seq_table import stop_reason

ROLES = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]
EOS_ID = 2
TOOLS_CORPUS = [
    'get the weather in paris: {"name": "get_weather", "arguments": {"city": "Paris"}}',
    "<tool_call> </tool_call> <tool_response> </tool_response> <tools> </tools>",
    "the quick brown fox jumps over the lazy dog; hello world, nice weather today",
    'call {"name": "f", "parameters": {"x": 1, "unit": "celsius"}} and tell me',
]
# Hermes-style: tools listed in a system turn, calls as <tool_call> JSON, results as
# <tool_response>. Whitespace control keeps the rendered text exact.
TOOLS_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if greeting is defined -%}<|system|>{{ greeting }}<|end|>{%- endif -%}"
    "{%- if documents -%}<|system|>{% for d in documents %}{{ d.text }}{% endfor %}<|end|>"
    "{%- endif -%}"
    "{%- if tools -%}<|system|>You may call these tools:\n<tools>\n"
    "{%- for tool in tools %}{{ tool | tojson }}\n{% endfor -%}</tools><|end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls is defined and m.tool_calls -%}"
    "<|assistant|>{{ m.content }}"
    "{%- for tc in m.tool_calls -%}"
    '<tool_call>{"name": "{{ tc.function.name }}", "arguments": '
    "{{ tc.function.arguments | tojson }}}</tool_call>"
    "{%- endfor -%}<|end|>"
    "{%- elif m.role == 'tool' -%}<|tool|><tool_response>{{ m.content }}</tool_response><|end|>"
    "{%- else -%}<|{{ m.role }}|>{{ m.content }}<|end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def build_tools_tokenizer(path: Path, extra_special: tuple[str, ...] = ()) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<s>", "</s>", *ROLES, *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TOOLS_CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    config["chat_template"] = TOOLS_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def echo_reply(prompt: list[int], user_id: int, end_id: int) -> list[int] | None:
    """The tokens of the last user message's content, or None without one."""
    starts = [i for i, t in enumerate(prompt) if t == user_id]
    if not starts:
        return None
    rest = prompt[starts[-1] + 1 :]
    return rest[: rest.index(end_id)] if end_id in rest else rest


class EchoExecutor(FakeExecutor):
    """The fake executor, answering each request with its last user message."""

    def __init__(self, *, user_id: int, end_id: int, **options):
        super().__init__(**options)
        self.user_id, self.end_id = user_id, end_id
        self.replies: dict[str, list[int] | None] = {}

    def execute(self, plan):
        for new in plan.new_seqs:
            prompt = new.token_ids[: new.num_prompt_tokens]
            self.replies[new.label] = echo_reply(prompt, self.user_id, self.end_id)
        return super().execute(plan)

    def _next_token(self, request_id: str, output_pos: int, params: SamplingParams) -> int:
        reply = self.replies.get(request_id)
        if reply is None:
            return super()._next_token(request_id, output_pos, params)
        if output_pos < len(reply):
            return reply[output_pos]
        if output_pos < params.min_tokens:  # EOS is masked until then, as the sampler does
            return self.token_at(request_id, output_pos)
        return self.eos_token_id


@dataclass(frozen=True)
class Echo(FakeModel):
    """The fake model answering each request with its last user message: the ids
    of ``<|user|>`` and ``<|end|>`` in the tokenizer say where that is."""

    user_id: int = -1
    end_id: int = -1

    def build(self, config: Any, rank: int, world_size: int, device: str, all_reduce: Any,
              runtime: dict | None = None):  # fmt: skip
        options = self.executor_options(config)
        return EchoExecutor(user_id=self.user_id, end_id=self.end_id, **options)


def echo_engine(tokenizer_dir: Path, **overrides: Any) -> dict:
    """An EngineConfig dict for the real server with the echo stand-in: the model
    answers each request with its last user message (conftest's ``fake_engine``)."""
    from iterserve.workers.tokenizer import Tokenizer
    from tests.serve.conftest import fake_engine

    tok = Tokenizer(tokenizer_dir)
    options = {
        "user_id": tok.token_to_id("<|user|>"),
        "end_id": tok.token_to_id("<|end|>"),
        "max_model_len": 1024,
    }
    overrides = {"num_kv_blocks": 2048, **overrides}
    return fake_engine(tok.vocab_size, executor="echo", executor_options=options, **overrides)


class EchoStream:
    """One request of :class:`EchoEngine`: an output per token, as an engine replica
    sends; the first brings the prompt's logprobs when they are asked for (every
    prompt token at -0.5, as the fake executor has them). ``pooled``: a pooling
    engine's vector of the prompt, with its one output."""

    def __init__(self, tokens: list[int], params: dict, prompt: list[int], pooled=None):
        # The sampling parameters as an engine reads them (tenant and target aside).
        self.tokens, self.params = tokens, engine_request("e", "e", prompt, params, 0).params
        self.prompt = prompt
        self.pooled = pooled
        self.cancelled = False

    async def __aiter__(self):
        prompt = None
        if self.params.prompt_logprobs is not None:
            rest = self.prompt[1:]
            top = [[(t, -0.5)][: self.params.prompt_logprobs] for t in rest]
            prompt = PromptLogprobs(0, [-0.5] * len(rest), [1] * len(rest), top)
        if not self.tokens:  # max_tokens 0: the prompt alone
            yield [EngineOutput("echo", [], [], prompt, "length", None, 0, self.pooled)]
            return
        for n, token in enumerate(self.tokens, start=1):
            if self.cancelled:
                return
            reason = stop_reason(self.params, n, token, frozenset({EOS_ID}))
            logprobs = []
            if self.params.logprobs is not None:
                logprobs = [(-0.5, [(token, -0.5)][: self.params.logprobs])]
            cached = 0 if n == 1 else None
            finish = reason.value if reason else None
            yield [EngineOutput("echo", [token], logprobs, prompt, finish, None, cached)]
            prompt = None
            if reason is not None:
                return

    def cancel(self) -> None:
        self.cancelled = True


class EchoEngine:
    """An in-process EngineClient: the reply is the last user message, then EOS
    (past the reply, with ignore_eos, it repeats EOS until max_tokens). With
    ``pooling`` it stands in for a pooling engine: a prompt's vector is
    :meth:`pooled` of it."""

    def __init__(self, tokenizer, max_model_len: int = 1024, pooling: bool = False):
        self.user_id = tokenizer.token_to_id("<|user|>")
        self.end_id = tokenizer.token_to_id("<|end|>")
        self.info_ = {"max_model_len": max_model_len, "vocab_size": tokenizer.vocab_size}
        self.pooling = pooling
        if pooling:
            self.info_["hidden_size"] = 4
        self.opened: list[tuple[list[int], dict]] = []

    @staticmethod
    def pooled(prompt: list[int]) -> list[float]:
        return [float(len(prompt)), float(prompt[-1]), -1.0, 0.0]

    async def open(self, request_id, prompt_token_ids, params, priority):
        self.opened.append((list(prompt_token_ids), params))
        reply = echo_reply(list(prompt_token_ids), self.user_id, self.end_id) or [5, 6, 7]
        tokens = (reply + [EOS_ID] * params["max_tokens"])[: params["max_tokens"]]
        pooled = self.pooled(list(prompt_token_ids)) if self.pooling else None
        return EchoStream(tokens, params, list(prompt_token_ids), pooled)

    async def info(self) -> dict:
        return self.info_

    async def stats(self) -> list[dict]:
        return []

    async def health(self) -> list[dict]:
        return [{"healthy": True, "ready": True, "message": "ok", "replica": "echo"}]

"""From a validated request to engine jobs: checked sampling parameters for each
prompt, then one job (engine request and choice) per choice.

This is where a request field becomes an engine setting. vLLM's engine-side
extensions are converted once per request (:func:`extension_fields`: logit bias
keys to token ids, bad words to token sequences) and, with the grammar of
structured outputs, handed to ``sampling_params``.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from typing import Any

from ...scheduler.sampling import MAX_BAD_WORDS as MAX_BAD_WORD_SEQUENCES
from ...scheduler.sampling import MAX_SEED, SamplingParams, SamplingParamsError
from .errors import APIError, bad_request
from .generation import Choice, Job
from .tenancy import scheduling_fields

_PLAIN_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
# Request fields passed to SamplingParams as they are (when set).
_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "seed",
)  # fmt: skip


def engine_id_prefix(request_id: str) -> str:
    """Engine requests are named ``<request id>-<choice index>`` so logs and
    stats can be traced back; a request id that is not a short plain token is
    replaced rather than sent to the scheduler."""
    return request_id if _PLAIN_ID.fullmatch(request_id) else uuid.uuid4().hex


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the engines' configuration allows (``max_n``, ``max_logprobs``), their
    facts (``max_model_len``, ``vocab_size``), and the sampling defaults of fields a
    request leaves unset (``--generation-config``; ``max_tokens`` caps the default)."""

    max_n: int
    max_logprobs: int
    max_model_len: int
    vocab_size: int
    sampling_defaults: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)


MAX_BAD_WORDS = MAX_BAD_WORD_SEQUENCES // 2  # each word tokenizes two ways at most
# Characters of a bad word: tokenized, a character is at most 4 bytes, so a word
# always fits the engine's MAX_BAD_WORD_LEN tokens.
MAX_BAD_WORD_CHARS = 64
_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def extension_fields(request, tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """The request's ``logit_bias``, ``allowed_token_ids``, ``bad_words`` and
    ``prompt_logprobs`` as SamplingParams fields (their ranges are checked there)."""
    fields: dict[str, Any] = {}
    if request.logit_bias:
        bias: dict[int, float] = {}
        for key, value in request.logit_bias.items():
            if not _TOKEN_ID.fullmatch(key):
                raise bad_request(f"logit_bias: keys must be token ids, got {key!r}", "logit_bias")
            if int(key) >= vocab_size:
                message = f"logit_bias: token ids must be in [0, {vocab_size - 1}], got {key}"
                raise bad_request(message, "logit_bias")
            bias[int(key)] = value
        fields["logit_bias"] = tuple(sorted(bias.items()))
    if request.allowed_token_ids is not None:
        fields["allowed_token_ids"] = tuple(request.allowed_token_ids)
    if request.bad_words:
        fields["bad_words"] = bad_word_ids(request.bad_words, tokenizer)
    if request.prompt_logprobs is not None:
        fields["prompt_logprobs"] = request.prompt_logprobs
    return fields


def bad_word_ids(words: list[str], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """Each word's tokens as they appear at the start of a text and after a space
    (vLLM's rule): both are banned, so the word never appears either way."""
    if len(words) > MAX_BAD_WORDS:
        raise bad_request(
            f"bad_words: at most {MAX_BAD_WORDS} words, got {len(words)}", "bad_words"
        )
    sequences: list[tuple[int, ...]] = []
    for word in words:
        if not word.strip():
            raise bad_request("bad_words: each must be a non-empty word", "bad_words")
        if len(word) > MAX_BAD_WORD_CHARS:
            message = f"bad_words: each must be at most {MAX_BAD_WORD_CHARS} characters"
            raise bad_request(f"{message}, got {len(word)}", "bad_words")
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in sequences:
                sequences.append(ids)
    return tuple(sequences)


def sampling_params(
    request,
    max_tokens: int | None,
    prompt_len: int,
    limits: Limits,
    logprobs: int | None,
    default_max_tokens: int | None = None,
    extensions: dict[str, Any] | None = None,
    prompt_only: bool = False,
) -> SamplingParams:
    """``default_max_tokens`` applies when the request sets none; None: the room
    left in the context. ``extensions``: SamplingParams fields already converted
    (:func:`extension_fields`, the grammar). ``prompt_only``: ``max_tokens: 0``
    is allowed (an echo of the prompt alone)."""
    room = limits.max_model_len - prompt_len
    if room < 1:  # the prompt alone fills the context: say so before any other field
        completion_len = max_tokens if max_tokens is not None and max_tokens >= 1 else 1
        raise context_error(request, limits.max_model_len, prompt_len, completion_len)
    # The configured caps first, so the message states the range that applies here.
    if request.n > limits.max_n:
        raise SamplingParamsError("n", f"must be in [1, {limits.max_n}], got {request.n}")
    if logprobs is not None and logprobs > limits.max_logprobs:
        message = f"must be in [0, {limits.max_logprobs}], got {logprobs}"
        raise SamplingParamsError("logprobs", message)
    defaults = dict(limits.sampling_defaults)
    default_cap = defaults.pop("max_tokens", None)
    fields = defaults | {
        name: getattr(request, name)
        for name in _SAMPLING_FIELDS
        if getattr(request, name) is not None
    }
    if fields.get("top_k") == -1:  # vLLM's and Hugging Face's "off"
        fields["top_k"] = 0
    if max_tokens is None:
        if default_cap is not None:  # the checkpoint's max_new_tokens bounds the default
            default_max_tokens = min(default_max_tokens or default_cap, default_cap)
        if default_max_tokens is None:
            max_tokens = room
        else:  # a default never contradicts the request's own min_tokens
            max_tokens = min(max(default_max_tokens, request.min_tokens or 0), room)
    if max_tokens == 0 and not prompt_only:
        raise SamplingParamsError("max_tokens", "must be at least 1 (0 only with echo), got 0")
    fields.update(
        n=request.n,
        max_tokens=max_tokens,
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        stop_token_ids=tuple(request.stop_token_ids or ()),
        **(extensions or {}),
    )
    params = SamplingParams(**fields)
    params.check_limits(
        max_n=limits.max_n, max_logprobs=limits.max_logprobs, vocab_size=limits.vocab_size
    )
    if params.max_tokens > room:
        raise context_error(request, limits.max_model_len, prompt_len, params.max_tokens)
    return params


def build_jobs(
    request,
    prompts: list[list[int]],
    tokenizer: Any,
    limits: Limits,
    *,
    logprobs: int | None,
    request_id: str,
    renames: dict[str, str],
    default_max_tokens: int | None = None,
    skip_special_tokens: bool | None = None,
    extensions: dict[str, Any] | None = None,
    prompt_only: bool = False,
) -> list[Job]:
    """One job per choice of every prompt. ``renames`` maps a SamplingParams field to
    the request field a client sent (``logprobs`` is chat's ``top_logprobs``)."""
    stops = request.stop_strings()
    max_tokens, field = request.output_len()
    renames = {**renames, "max_tokens": field}
    if skip_special_tokens is None:
        skip_special_tokens = request.skip_special_tokens
    prefix = engine_id_prefix(request_id)
    scheduling = scheduling_fields(request)  # its tenant and first-token target
    jobs = []
    try:
        for p, prompt in enumerate(prompts):
            params = sampling_params(
                request, max_tokens, len(prompt), limits, logprobs, default_max_tokens,
                extensions, prompt_only,
            )  # fmt: skip
            for j in range(request.n):
                # Choice j of every prompt uses seed + j: the same prompt and seed
                # give the same choices alone or in a batch. It wraps past MAX_SEED,
                # so every seed the API accepts works with every n.
                seed = None if params.seed is None else (params.seed + j) % (MAX_SEED + 1)
                one = dataclasses.asdict(dataclasses.replace(params, n=1, seed=seed))
                one.update(scheduling)
                index = p * request.n + j
                detokenizer = tokenizer.detokenizer(
                    prompt, skip_special_tokens, request.spaces_between_special_tokens
                )
                choice = Choice(
                    index,
                    detokenizer,
                    stops,
                    logprobs is not None,
                    include_stop_str=request.include_stop_str_in_output,
                )
                jobs.append(Job(f"{prefix}-{index}", prompt, one, request.priority, choice))
    except SamplingParamsError as exc:
        field = renames.get(exc.field, exc.field)
        message = str(exc).removeprefix(f"{exc.field}: ")
        raise bad_request(f"{field}: {message}", field) from None
    return jobs


def context_error(request, max_model_len: int, prompt_len: int, completion_len: int) -> APIError:
    where = "messages" if hasattr(request, "messages") else "prompt"
    return APIError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {prompt_len + completion_len} tokens ({prompt_len} in the {where}, "
        f"{completion_len} in the completion). Please reduce the length of the "
        f"{where} or completion.",
        param=where,
        code="context_length_exceeded",
    )

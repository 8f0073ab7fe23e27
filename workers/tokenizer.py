"""Tokenizer, chat template and streaming detokenizer for a local checkpoint.

Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` (special tokens,
``add_bos_token``/``add_eos_token``, ``chat_template``), ``chat_template.jinja``
or ``chat_template.json`` when the template lives there, and
``generation_config.json`` (extra EOS ids). Chat templates are untrusted input:
they run in Jinja's immutable sandbox, and any unsafe access is an error rather
than a silently empty value. Importing this module does not import torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

REPLACEMENT_CHAR = "\ufffd"
# Marks the end of the message to continue (continue_final_message); a private-use
# character no tokenizer or template has a reason to produce or strip.
_CONTINUE_MARK = "\U000f0000"


class TokenizerError(ValueError):
    """A tokenizer file or chat template is missing, malformed or unsafe."""


def _load_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path.name}: cannot parse {path}: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path.name}: {path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"tokenizer_config.json: cannot read special token {value!r}")


def _ids(value: Any) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    # Hugging Face's variant: unlike Jinja's own filter it leaves <, > and & alone.
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__} is unsafe")


def _environment() -> jinja2.Environment:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _component_types(component: Any) -> set[str]:
    """The types of a tokenizer.json component, inside a Sequence too."""
    if not isinstance(component, dict):
        return set()
    types = {component.get("type")}
    for part in component.get("decoders") or component.get("pretokenizers") or []:
        types |= _component_types(part)
    return {t for t in types if isinstance(t, str)}


@dataclass(frozen=True)
class GrammarVocabulary:
    """What a grammar engine (xgrammar) needs of a vocabulary: each token as the
    tokenizer spells it, by id (special tokens empty, so never text), how those
    spellings encode bytes (``byte_level``: GPT-2's byte-to-unicode alphabet, as
    Llama 3 and Qwen; ``byte_fallback``: SentencePiece's ``▁`` and ``<0xNN>``, as
    Llama 2; ``raw``: as they are), and whether encoding prepends a space."""

    tokens: list[str]
    kind: str
    add_prefix_space: bool


class Tokenizer:
    """A checkpoint directory's tokenizer."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        file = self.path / "tokenizer.json"
        if not file.exists():
            raise TokenizerError(f"tokenizer.json: {file} not found")
        try:
            self._tok = _HFTokenizer.from_file(str(file))
        except Exception as exc:
            raise TokenizerError(f"tokenizer.json: cannot load {file}: {exc}") from None
        config = _load_json(self.path / "tokenizer_config.json")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        self.unk_token = _token_text(config.get("unk_token"))
        # Hugging Face's Llama tokenizers add BOS/EOS by these flags, not by the
        # post-processor in tokenizer.json; when a flag is present it wins.
        self._add_bos = config.get("add_bos_token")
        self._add_eos = config.get("add_eos_token")
        self.chat_template = self._find_template(config.get("chat_template"))
        self._template: jinja2.Template | None = None
        self._added: dict[int, tuple[str, bool]] | None = None

        gen = _load_json(self.path / "generation_config.json")
        eos = set(_ids(gen.get("eos_token_id")))
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        self.eos_token_ids = frozenset(eos)

    def _find_template(self, value: Any) -> str | None:
        if isinstance(value, list):
            # Older files hold several named templates; "default" is the chat one.
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            value = named.get("default") or next(iter(named.values()), None)
        if isinstance(value, str):
            return value
        jinja_file = self.path / "chat_template.jinja"
        if jinja_file.exists():
            return jinja_file.read_text(encoding="utf-8")
        from_json = _load_json(self.path / "chat_template.json").get("chat_template")
        return from_json if isinstance(from_json, str) else None

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._add_bos is None and self._add_eos is None:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self._add_bos and self.bos_token_id is not None:
                ids = [self.bos_token_id, *ids]
            if self._add_eos and self.eos_token_id is not None:
                ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def added_tokens(self) -> dict[int, tuple[str, bool]]:
        """Tokens added on top of the model's vocabulary: id -> (text, special)."""
        if self._added is None:
            decoder = self._tok.get_added_tokens_decoder()
            self._added = {i: (t.content, t.special) for i, t in decoder.items()}
        return self._added

    @property
    def special_tokens(self) -> frozenset[str]:
        return frozenset(text for text, special in self.added_tokens.values() if special)

    def grammar_vocabulary(self) -> GrammarVocabulary:
        """The vocabulary as a grammar engine reads it (see :class:`GrammarVocabulary`)."""
        tokens = [""] * self.vocab_size
        for token, token_id in self._tok.get_vocab(with_added_tokens=True).items():
            if token_id < len(tokens):
                tokens[token_id] = token
        for token_id, (_, special) in self.added_tokens.items():
            if special and token_id < len(tokens):
                # Never text: a grammar must not spell "<|eos|>" inside a JSON string.
                tokens[token_id] = ""
        spec = json.loads(self._tok.to_str())
        decoders = _component_types(spec.get("decoder"))
        if "ByteLevel" in decoders:
            kind, space = "byte_level", "\u0120"  # GPT-2's spelling of a space: Ġ
        elif decoders & {"ByteFallback", "Metaspace"}:
            kind, space = "byte_fallback", "\u2581"  # SentencePiece's: ▁
        else:
            kind, space = "raw", " "
        first = self._tok.encode("a", add_special_tokens=False).tokens
        return GrammarVocabulary(tokens, kind, bool(first) and first[0].startswith(space))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        **variables: Any,
    ) -> str:
        """The prompt text for ``messages``, as Hugging Face's ``apply_chat_template``
        renders it: ``tools`` and ``documents`` (None when absent) and any extra
        ``variables`` are the template's to use.

        ``continue_final_message``: the prompt ends inside the last message, right
        after its content, so the model continues it. The content is marked, the
        chat rendered, and the text cut at the mark (the end-of-turn the template
        writes after it is dropped).

        The template writes any BOS itself, so encode the result with
        ``add_special_tokens=False``.
        """
        if self.chat_template is None:
            raise TokenizerError(f"no chat template in {self.path}")
        if continue_final_message:
            if not messages:
                raise TokenizerError("continue_final_message: there is no message to continue")
            last = dict(messages[-1])
            last["content"] = (last.get("content") or "") + _CONTINUE_MARK
            messages = [*messages[:-1], last]
        try:
            if self._template is None:
                self._template = _environment().from_string(self.chat_template)
            text = self._template.render(
                **variables,
                messages=messages,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                pad_token=self.pad_token or "",
                unk_token=self.unk_token or "",
            )
        except SecurityError as exc:
            raise TokenizerError(f"chat template is unsafe: {exc}") from None
        except TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from None
        except Exception as exc:  # a template's own bug (a str + None, ...) met these inputs
            raise TokenizerError(f"chat template failed: {type(exc).__name__}: {exc}") from None
        if continue_final_message:
            cut = text.rfind(_CONTINUE_MARK)
            if cut < 0:
                raise TokenizerError(
                    "continue_final_message: the chat template does not render the last "
                    "message's content as it is, so it cannot be continued"
                )
            text = text[:cut]
        return text

    def detokenizer(
        self,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self, prompt_ids, skip_special_tokens, spaces_between_special_tokens
        )


class IncrementalDetokenizer:
    """Streams one sequence's text, one token at a time.

    Decoding ids one by one is wrong twice over: a multi-byte character may be
    split across tokens, and some decoders (SentencePiece's leading space) render
    a token differently at the start of a text. So each step decodes a short
    window that starts a few tokens back and emits only what is new, holding
    the text back while it ends in an incomplete character (U+FFFD).
    """

    # Prompt tokens kept as left context: enough for the decoders' word-start rules.
    PROMPT_CONTEXT = 4

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Kept special tokens written back to back, as their own texts: some decoders
        # (SentencePiece's) put a space before a special token that follows another.
        self._tight = not skip_special_tokens and not spaces_between_special_tokens
        self._ids = list(prompt_ids[-self.PROMPT_CONTEXT :]) if prompt_ids else []
        self._prefix = 0  # window start
        self._read = len(self._ids)  # everything before this is emitted
        self.text = ""

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Appends one token; returns the text it completes (possibly "")."""
        if self._tight and self._follows_added(token_id):
            self._ids.append(token_id)
            self._prefix, self._read = len(self._ids) - 1, len(self._ids)
            delta = self._tokenizer.added_tokens[token_id][0]
            self.text += delta
            return delta
        self._ids.append(token_id)
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix)
        if len(after) <= len(before) or after.endswith(REPLACEMENT_CHAR):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        # The window never looks further back than _prefix.
        if self._prefix > 64:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        self.text += delta
        return delta

    def _follows_added(self, token_id: int) -> bool:
        # Only when everything before is emitted: an added token's text is whole.
        added = self._tokenizer.added_tokens
        return (
            token_id in added
            and self._read == len(self._ids)
            and bool(self._ids)
            and self._ids[-1] in added
        )

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """At the end of the sequence: whatever is held back, even an incomplete character."""
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix)
        delta = after[len(before) :] if len(after) > len(before) else ""
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta

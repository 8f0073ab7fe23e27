"""Request fields the server does not know, and fields it knows but cannot honour.

Clients built for OpenAI or vLLM send fields this server has never heard of
(``cache_control`` on a message, a tracing id, a newer OpenAI option). Such a
name is accepted and ignored, as OpenAI and vLLM do: the response lists it in
``x-iterserve-ignored-fields`` and the server logs it once. With
``strict_fields`` the request is refused instead (400 naming every such field).

A field the server knows but cannot honour is different: the client asked for
another output, so it is refused whatever ``strict_fields`` says (400 naming the
field and the reason), unless it holds its "not used" value.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import quote

from pydantic import BaseModel

from .errors import bad_request

logger = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "x-iterserve-ignored-fields"
MAX_HEADER_NAMES = 16  # names listed in the header; the rest are counted
MAX_NAME_LEN = 64  # characters of one name in the header and the log
MAX_LOGGED_NAMES = 1024  # distinct names logged; a client inventing names cannot flood the log


def unknown_fields(model: BaseModel, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The paths of every unknown name in a validated request, nested ones included
    (``("messages", "0", "cache_control")``), in the order they were sent."""
    found = [(*prefix, name) for name in model.model_extra or {}]
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            found += unknown_fields(value, (*prefix, name))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    found += unknown_fields(item, (*prefix, name, str(i)))
    return found


def _generic(path: tuple[str, ...]) -> str:
    """``messages.*.cache_control``: one name for the field whatever the index."""
    return ".".join("*" if part.isdigit() else part for part in path)


def _printable(name: str) -> str:
    # Names are arbitrary JSON keys: percent-encoded so that neither a header nor a
    # log line can be broken by what a client sends.
    text = quote(name, safe="._*-[]")
    return text if len(text) <= MAX_NAME_LEN else text[: MAX_NAME_LEN - 3] + "..."


def header_value(names: list[str]) -> str:
    shown = [_printable(n) for n in names[:MAX_HEADER_NAMES]]
    if len(names) > MAX_HEADER_NAMES:
        shown.append(f"(+{len(names) - MAX_HEADER_NAMES} more)")
    return ", ".join(shown)


class FieldPolicy:
    """Answers unknown names: ignored and reported, or refused (``strict``)."""

    def __init__(self, strict: bool = False):
        self.strict = strict
        self._logged: set[str] = set()

    def ignored(self, request: BaseModel) -> list[str]:
        """The unknown names in ``request`` (each once, generic); raises 400 when strict."""
        paths = unknown_fields(request)
        if not paths:
            return []
        if self.strict:
            named = [".".join(p) for p in paths]
            shown = ", ".join(_printable(n) for n in named[:MAX_HEADER_NAMES])
            raise bad_request(f"unknown field(s): {shown}", param=named[0])
        names = list(dict.fromkeys(_generic(p) for p in paths))
        self._log(names)
        return names

    def _log(self, names: list[str]) -> None:
        new = [n for n in names if n not in self._logged]
        if not new or len(self._logged) >= MAX_LOGGED_NAMES:
            return
        self._logged.update(new)
        logger.warning(
            "request field(s) not known to this server, accepted and ignored: %s "
            "(each name is logged once; strict_fields refuses them)",
            ", ".join(_printable(n) for n in new),
        )
        if len(self._logged) >= MAX_LOGGED_NAMES:
            logger.warning("%d unknown field names logged; no more will be", MAX_LOGGED_NAMES)


def _unused(value: Any) -> bool:
    # 0 is a value (prompt_logprobs: 0 asks for the prompt's logprobs): only null,
    # false and empty containers mean "not used".
    return value is None or value is False or (isinstance(value, (str, list, dict)) and not value)


def check_refused(request: Any) -> None:
    """400 for the first field the request uses that this server cannot honour."""
    for name, reason in request.REFUSED.items():
        if not _unused(getattr(request, name)):
            raise bad_request(f"{name}: {reason}", param=name)

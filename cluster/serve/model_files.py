"""What the served model's files say, read where the server starts: which directory
a model name is, its chat template, its sampling defaults.

Nothing is downloaded. A model is a local directory, or a Hugging Face hub id
(``org/name``) whose snapshot is already in the local cache
(``$HF_HUB_CACHE``, ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``):
``models--org--name/snapshots/<revision>``, the one ``refs/main`` names, else the
newest that holds a ``config.json``.

Sampling defaults follow vLLM's ``--generation-config``: ``auto`` reads the
checkpoint's ``generation_config.json`` and keeps the keys vLLM keeps
(``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
``max_new_tokens``, each only where it differs from Hugging Face's default, as
``GenerationConfig.to_diff_dict`` drops the others); ``vllm`` takes none; a
directory reads its ``generation_config.json``. ``override_generation_config`` is
laid over them. A request's own field always wins; ``max_new_tokens`` caps the
``max_tokens`` a request leaves unset.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

# The generation_config.json keys that become sampling defaults, with Hugging Face's
# own default for each (a key equal to it is dropped, as vLLM drops it).
SAMPLING_KEYS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "min_p": None,
    "repetition_penalty": 1.0,
    "max_new_tokens": None,
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFoundError(ValueError):
    """A model name that is neither a directory nor in the local Hugging Face cache."""


def hub_cache(download_dir: str | None = None) -> Path:
    """The Hugging Face hub cache this machine's tools write to."""
    if download_dir:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(home).expanduser() / "hub"


def resolve_model(name: str, download_dir: str | None = None) -> tuple[str, bool]:
    """``(directory, from_hub)``: ``name`` itself when it is a directory, else its
    snapshot in the local Hugging Face cache; raises ModelNotFoundError otherwise."""
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path), False
    if not _HUB_ID.match(name) or name.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"model {name!r}: no such directory")
    cache = hub_cache(download_dir)
    repo = cache / f"models--{name.replace('/', '--')}"
    snapshot = _snapshot(repo)
    if snapshot is None:
        raise ModelNotFoundError(
            f"model {name!r} is neither a local directory nor in the Hugging Face cache "
            f"({cache}); iterserve downloads nothing: fetch it first "
            f"(`huggingface-cli download {name}`) or give its directory"
        )
    return str(snapshot), True


def _snapshot(repo: Path) -> Path | None:
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    main = repo / "refs" / "main"
    if main.is_file():
        named = snapshots / main.read_text(encoding="utf-8").strip()
        if (named / "config.json").exists():
            return named
    found = [s for s in snapshots.iterdir() if (s / "config.json").exists()]
    return max(found, key=lambda s: s.stat().st_mtime) if found else None


def chat_template_text(value: str) -> str:
    """``--chat-template``: a file's text, else the value as the template itself;
    raises ValueError when it is neither readable nor a template."""
    import jinja2

    path = Path(value).expanduser()
    looks_like_path = "{" not in value and len(value) < 4096
    if looks_like_path and path.is_file():
        text = path.read_text(encoding="utf-8")
    elif looks_like_path and ("/" in value or path.suffix in (".jinja", ".j2", ".txt")):
        raise ValueError(f"chat_template: no file {value}")
    else:
        text = value.encode().decode("unicode_escape") if "\\n" in value else value
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template: not a Jinja template: {exc}") from None
    return text


def sampling_defaults(
    setting: str, model_path: str, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The sampling defaults (SamplingParams field names; ``max_tokens`` for
    ``max_new_tokens``) that ``--generation-config`` and its overrides give."""
    if setting == "vllm":
        found: dict[str, Any] = {}
    else:
        folder = Path(model_path if setting == "auto" else setting).expanduser()
        if setting != "auto" and not folder.is_dir():
            raise ValueError(f"generation_config: {setting} is neither auto, vllm nor a directory")
        found = _read_generation_config(folder / "generation_config.json")
        found = {k: v for k, v in found.items() if k in SAMPLING_KEYS and v != SAMPLING_KEYS[k]}
    for key in overrides or {}:
        if key not in SAMPLING_KEYS:
            raise ValueError(
                f"override_generation_config: unknown key {key!r} (known: "
                f"{', '.join(SAMPLING_KEYS)})"
            )
    found.update(overrides or {})
    defaults = {("max_tokens" if k == "max_new_tokens" else k): v for k, v in found.items()}
    _check(defaults)
    return defaults


def _read_generation_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"generation_config: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"generation_config: {path} must hold a JSON object")
    return data


def _check(defaults: dict[str, Any]) -> None:
    """Defaults every request would be refused for are refused once, at start."""
    from ...scheduler.sampling import SamplingParams, SamplingParamsError

    try:
        SamplingParams(**defaults)
    except (SamplingParamsError, TypeError, ValueError) as exc:
        raise ValueError(f"generation_config: {exc}") from None

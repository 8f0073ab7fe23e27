"""LoRA adapters at the serving edge, with vLLM's interface.

- Flags: ``--enable-lora``, ``--lora-modules NAME=PATH`` (or vLLM's JSON form
  ``{"name": ..., "path": ..., "base_model_name": ...}``, read by
  :func:`parse_lora_module`), ``--max-loras``, ``--max-lora-rank``,
  ``--max-cpu-loras``: the engine config's keys, as every knob's flag
  (:mod:`~iterserve.cluster.serve.flags`).
- ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` with
  ``{"lora_name", "lora_path"}`` load and unload adapters at runtime, on every
  engine replica; a bad adapter is a 400 naming the problem, and nothing is loaded.
- A request's ``model`` names an adapter (or the base model); ``/v1/models``
  lists each adapter with its ``parent``.

The engine replica keeps the registry (:class:`EngineAdapters`, over the
scheduler's :class:`~iterserve.scheduler.adapters.AdapterResidency`); an
ingress keeps only the names it has seen (:class:`AdapterDirectory`), refreshed
from the engines when a request names one it does not know. A replica Serve
starts later loads the configured ``lora_modules``, not adapters loaded at
runtime since.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from ..scheduler.adapters import AdapterNotFoundError

# -- configuration ---------------------------------------------------------------------


def normalize_lora_modules(value: Any) -> dict[str, dict[str, Any]]:
    """``lora_modules`` as ``{name: {"path", "base_model_name"}}``, from a mapping of
    names to paths or to such dicts; raises ValueError naming the bad entry."""
    if not isinstance(value, dict):
        raise ValueError(f"lora_modules must be a mapping of names to paths, got {value!r}")
    out = {}
    for name, entry in value.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"lora_modules: adapter names must be non-empty strings, got {name!r}")
        if isinstance(entry, str):
            entry = {"path": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise ValueError(f"lora_modules.{name}: a path, or a mapping with a path")
        unknown = sorted(set(entry) - {"path", "base_model_name"})
        if unknown:
            raise ValueError(f"lora_modules.{name}: unknown keys {', '.join(unknown)}")
        out[name] = {"path": entry["path"], "base_model_name": entry.get("base_model_name")}
    return out


def parse_lora_module(text: str) -> dict[str, dict[str, Any]]:
    """One ``--lora-modules`` value: ``NAME=PATH`` or vLLM's JSON object."""
    text = text.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--lora-modules: not JSON: {exc}") from None
        if not isinstance(data, dict) or not {"name", "path"} <= set(data):
            raise ValueError("--lora-modules: JSON needs name and path")
        entry = {"path": data["path"], "base_model_name": data.get("base_model_name")}
        return {data["name"]: entry}
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: NAME=PATH, got {text!r}")
    return {name: {"path": path, "base_model_name": None}}


# -- the engine's registry ----------------------------------------------------------------


class EngineAdapters:
    """An engine's adapters: checked against its base model, registered with its
    scheduler. Methods answer ``None`` or a refusal ``(kind, message)``: kind is
    ``invalid`` (400) or ``not_found`` (404)."""

    def __init__(self, config: Any, scheduler: Any, model_name: str, *,
                 check_weights: bool = True):  # fmt: skip
        """``check_weights``: check an adapter's tensors against the checkpoint (the
        ranks run the model); off for a stand-in executor, which reads its config."""
        self.config, self.scheduler, self.model_name = config, scheduler, model_name
        self.check_weights = check_weights
        self._model_config = None

    @property
    def enabled(self) -> bool:
        return bool(self.config.enable_lora)

    def _check(self, path: str) -> None:
        """Raises AdapterError when the ranks could not serve the adapter."""
        from ..workers.lora import _read_config, check_adapter

        if not self.check_weights:  # a stand-in executor: the config file only
            from pathlib import Path

            _read_config(Path(path), self.config.max_lora_rank)
            return
        if self._model_config is None:
            from ..workers.checkpoint import load_checkpoint

            ckpt = load_checkpoint(self.config.model_path)
            self._model_config = ckpt.config
            ckpt.close()
        check_adapter(path, self._model_config, self.config.max_lora_rank)

    def load(self, name: Any, path: Any, base_model_name: Any = None) -> tuple[str, str] | None:
        from ..workers.lora import AdapterError

        if not self.enabled:
            return ("invalid", "LoRA adapters are not enabled on this server (enable_lora)")
        if not isinstance(name, str) or not name.strip():
            return ("invalid", "lora_name: a non-empty string is required")
        if not isinstance(path, str) or not path:
            return ("invalid", "lora_path: a non-empty string is required")
        if name == self.model_name:
            return ("invalid", f"lora_name: {name!r} is the base model's name")
        if name in self.scheduler.adapters.registered:
            return ("invalid", f"lora_name: an adapter named {name!r} is loaded already")
        try:
            self._check(path)
        except AdapterError as exc:
            return ("invalid", f"adapter {name!r}: {exc}")
        base = base_model_name if isinstance(base_model_name, str) else None
        self.scheduler.adapters.register(name, path, base)
        return None

    def unload(self, name: Any) -> tuple[str, str] | None:
        if not self.enabled:
            return ("invalid", "LoRA adapters are not enabled on this server (enable_lora)")
        try:
            self.scheduler.adapters.unregister(name)
        except AdapterNotFoundError:
            return ("not_found", f"lora_name: no adapter named {name!r} is loaded")
        return None

    def load_configured(self) -> None:
        """Loads ``lora_modules``; a bad one stops the engine from starting."""
        for name, entry in self.config.lora_modules.items():
            refusal = self.load(name, entry["path"], entry.get("base_model_name"))
            if refusal is not None:
                raise ValueError(f"lora_modules.{name}: {refusal[1]}")

    def listing(self) -> list[dict[str, Any]]:
        residency = self.scheduler.adapters
        return [
            {
                "name": a.name,
                "path": a.path,
                "base_model_name": a.base_model_name,
                "resident": a.adapter_id in residency.slot_of,
            }  # fmt: skip
            for a in residency.registered.values()
        ]

    def stats(self) -> dict[str, Any]:
        """Residency and, per adapter, its requests running and waiting."""
        sched = self.scheduler
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for request in sched.requests.values():
            if request.lora_name is None:
                continue
            counts = running if request.slot_idx >= 0 else waiting
            counts[request.lora_name] = counts.get(request.lora_name, 0) + 1
        residency = sched.adapters
        return {
            "lora_resident": residency.num_resident,
            "lora_loads": residency.num_loads,
            "lora_evictions": residency.num_evictions,
            "lora_running": running,
            "lora_waiting": waiting,
        }


# -- the ingress's view ------------------------------------------------------------------


class AdapterDirectory:
    """The adapter names an ingress accepts as ``model``, with their parents:
    refreshed from the engines when a request names one not seen yet, and kept
    up to date by the load and unload calls that pass through this ingress."""

    def __init__(self, engines: Any, base_model: str):
        self.engines, self.base_model = engines, base_model
        self.adapters: dict[str, dict[str, Any]] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    async def refresh(self) -> None:
        listings = await self.engines.call_all("lora_adapters")
        known: dict[str, dict[str, Any]] = {}
        for listing in listings:
            if isinstance(listing, list):
                for entry in listing:
                    known.setdefault(entry["name"], entry)
        self.adapters = known

    def cards(self, created: int) -> list[dict[str, Any]]:
        """``/v1/models`` entries of the adapters, as vLLM lists them."""
        return [
            {"id": name, "object": "model", "created": created, "owned_by": "iterserve",
             "root": entry["path"], "parent": entry.get("base_model_name") or self.base_model}
            for name, entry in sorted(self.adapters.items())
        ]  # fmt: skip

    async def load(self, name: Any, path: Any, base_model_name: Any = None) -> tuple | None:
        """Loads on every engine replica; the first refusal is the answer (each
        replica checks the same files, so they agree)."""
        results = await self.engines.call_all("load_lora_adapter", name, path, base_model_name)
        return await self._settle(results)

    async def unload(self, name: Any) -> tuple | None:
        return await self._settle(await self.engines.call_all("unload_lora_adapter", name))

    async def _settle(self, results: list) -> tuple | None:
        await self.refresh()
        errors = [r for r in results if isinstance(r, BaseException)]
        refusals = [tuple(r) for r in results if isinstance(r, (list, tuple))]
        if refusals:
            return refusals[0]
        if errors or not results:
            return ("unavailable", f"no engine replica answered: {errors[0] if errors else ''}")
        return None


# -- the routes ---------------------------------------------------------------------------


def add_lora_routes(app: Any, serving: Any, max_body_bytes: int) -> None:
    """``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, as vLLM has
    them: a JSON body with ``lora_name`` (and ``lora_path`` to load); success is
    a 200 with a line of text, a refusal an OpenAI error (400, 404 or 503)."""
    from starlette.responses import PlainTextResponse

    from .openai.app import read_body
    from .openai.errors import APIError, unavailable
    from .openai.serving import load_json

    def refused(refusal: tuple, param: str) -> APIError:
        kind, message = refusal[0], refusal[1]
        if kind == "not_found":
            return APIError(404, message, param=param, code="model_not_found")
        if kind == "invalid":
            return APIError(400, message, param=param, code="invalid_adapter")
        return unavailable(message)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = load_json(await read_body(request, max_body_bytes))
        name, path = body.get("lora_name"), body.get("lora_path")
        for param, value in (("lora_name", name), ("lora_path", path)):
            if not isinstance(value, str) or not value:
                raise APIError(400, f"{param}: a non-empty string is required", param=param)
        refusal = await serving.lora.load(name, path, body.get("base_model_name"))
        if refusal is not None:
            raise refused(refusal, "lora_path")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = load_json(await read_body(request, max_body_bytes))
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise APIError(400, "lora_name: a non-empty string is required", param="lora_name")
        refusal = await serving.lora.unload(name)
        if refusal is not None:
            raise refused(refusal, "lora_name")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

"""The flags of ``iterserve serve`` and ``run-batch``, generated from the declarations.

Every engine knob (:func:`~iterserve.scheduler.config.knob`, in ``cluster/config.py``
and ``scheduler/config.py``) and every ingress setting (:class:`~.app.ServeArgs`)
is a flag, with no code of its own: its type, choices, bounds and help come from
the declaration. A flag is named as vLLM names the knob where vLLM has it
(:data:`VLLM_NAMES`, else ``--`` and the key with dashes) and sits in the help
group where vLLM puts it (:data:`GROUPS`). Where vLLM's flag means something
else than the knob, the flag converts (:data:`DERIVED`, and the docs' table):

- ``--gpu-memory-utilization U`` sets ``kv_memory_fraction`` to U (docs/serving.md
  says how the two budgets compare);
- ``--enable-chunked-prefill`` selects the ``chunked`` policy (``--no-...``: ``continuous``);
- ``--data-parallel-size N`` is N engine replicas;
- ``--dtype half`` and ``float`` are ``float16`` and ``float32``; ints take vLLM's
  ``8k`` (8000) and ``8K`` (8192), ``--max-model-len auto`` the checkpoint's.

Every other flag of ``vllm serve`` is in :mod:`~.vllm_flags`: accepted with a log
line, or refused with a sentence. The same names are the keys of a ``--config``
file (``max-num-seqs: 64`` or ``max_num_seqs: 64``); a flag wins over the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import typing
from collections.abc import Callable
from typing import Any

from ..config import SCHEDULER_KEYS, EngineConfig
from ..config_docs import Knob, knobs
from .vllm_flags import VLLM_FLAGS, VllmFlag

ENGINE, APP, CLI = "engine", "app", "cli"  # where a flag's value goes
_TAKES_VALUE = object()

# vLLM's names for our knobs and settings (the first is the one --help shows first).
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "tensor_parallel_size": ("--tensor-parallel-size", "-tp"),
    "num_kv_blocks": ("--num-gpu-blocks-override", "--num-kv-blocks"),
    "kv_memory_fraction": ("--gpu-memory-utilization", "--kv-memory-fraction"),
    "drain_timeout_s": ("--drain-timeout-s", "--shutdown-timeout"),
    "quantization": ("--quantization", "-q"),
    "num_engine_replicas": ("--data-parallel-size", "-dp", "--engine-replicas"),
    "model_name": ("--served-model-name",),
    "cors_allowed_origins": ("--allowed-origins", "--cors-allowed-origins"),
    "cors_allow_credentials": ("--allow-credentials", "--cors-allow-credentials"),
    "http_host": ("--host",),
    "http_port": ("--port",),
}
# Options kept from earlier iterserve releases that set a switch's value by themselves.
_EXTRA_SWITCHES = {"metrics_require_api_key": {"--metrics-without-api-key": False}}
# vLLM's help group of each knob; the rest: SchedulerConfig's keys under SchedulerConfig,
# the engine's under EngineConfig, the ingress's under Frontend.
_GROUP_OF = {
    "ModelConfig": "model dtype seed max_model_len max_logprobs quantization runner "
    "kernel_backend model_name generation_config override_generation_config",
    "StructuredOutputsConfig": "reasoning_parser",
    "ParallelConfig": "tensor_parallel_size num_engine_replicas autoscaling placement_strategy "
    "num_cpus_per_worker torch_threads device routing",
    "CacheConfig": "block_size kv_memory_fraction num_kv_blocks kv_layout enable_prefix_caching "
    "kv_cache_dtype kv_offloading_size kv_disk_cache_dir kv_disk_cache_size",
    "LoRAConfig": "enable_lora max_loras max_lora_rank max_cpu_loras",
    "ObservabilityConfig": "ray_metrics",
    "SchedulerConfig": "async_scheduling",
    "VllmConfig": "speculative_config kv_events_config",
    "FaultToleranceConfig": "step_timeout_s max_restarts restart_window_s drain_timeout_s "
    "health_check_period_s",
    "Frontend": "lora_modules",
}
GROUPS = {key: group for group, keys in _GROUP_OF.items() for key in keys.split()}
GROUP_ORDER = (
    "options", "Frontend", "ModelConfig", "LoadConfig", "AttentionConfig",
    "StructuredOutputsConfig", "ParallelConfig", "CacheConfig", "MultiModalConfig",
    "LoRAConfig", "ObservabilityConfig", "SchedulerConfig", "CompilationConfig", "VllmConfig",
    "FaultToleranceConfig", "EngineConfig",
)  # fmt: skip
# The command's defaults where a Serve config's (ServeArgs') differ: `iterserve serve`
# answers HTTP itself on port 8000, as vLLM does.
SERVE_DEFAULTS = {"http_host": "127.0.0.1", "http_port": 8000}
# Settings the builder takes that are no flag: the model (the positional argument)
# and the engine config (the flags themselves).
_NOT_FLAGS = {"model", "config"}


@dataclasses.dataclass(frozen=True)
class Flag:
    """One setting as options: ``options`` maps each option string to the value it
    sets by itself (a switch) or to ``_TAKES_VALUE``."""

    key: str
    target: str  # ENGINE, APP or CLI
    options: dict[str, Any]
    group: str
    help: str
    convert: Callable[[Any], Any] = str
    nargs: Any = None
    choices: tuple | None = None
    metavar: str | None = None

    @property
    def name(self) -> str:
        return next(iter(self.options))

    def value(self, option: str, given: Any) -> Any:
        """The setting's value from ``option`` given ``given`` (text, or what a
        config file holds); raises ValueError naming what is wrong."""
        const = self.options[option]
        if const is not _TAKES_VALUE:
            return const
        if self.nargs == "+":
            items = given if isinstance(given, list) else [given]
            for item in items:
                self._check(item)
            return self.convert(items)
        self._check(given)
        return self.convert(given) if isinstance(given, str) else given

    def _check(self, given: Any) -> None:
        if self.choices and str(given) not in self.choices:
            raise ValueError(f"must be one of {', '.join(map(str, self.choices))}")


# -- conversions (vLLM's spellings of values) ------------------------------------------------

_HUMAN = re.compile(r"^(\d+(?:\.\d+)?)([kKmMgG])$")


def human_int(text: str) -> int:
    """An int as vLLM takes one: ``2048``, ``8k`` (8000), ``8K`` (8192), ``1.5m``."""
    match = _HUMAN.match(text.strip())
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise ValueError("must be an integer (or vLLM's 8k, 8K)") from None
    number, unit = float(match.group(1)), match.group(2)
    base = 1000 if unit.islower() else 1024
    return int(number * base ** "kmg".index(unit.lower()) * base)


def _context_len(text: str) -> int | None:
    return None if text.strip().lower() in ("auto", "-1") else human_int(text)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    return value


def _origins(text: str) -> list[str]:
    """vLLM's JSON list (``'["*"]'``), or a comma-separated list."""
    if text.strip().startswith("["):
        value = json.loads(text)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError("must be a JSON list of origins")
        return value
    return [origin.strip() for origin in text.split(",") if origin.strip()]


def _names(values: list[str]) -> str | list[str]:
    return values[0] if len(values) == 1 else list(values)


def _lora_modules(values: list) -> dict:
    from ..lora import parse_lora_module

    out: dict = {}
    for value in values:
        out.update(parse_lora_module(value) if isinstance(value, str) else value)
    return out


_DTYPE_ALIASES = {"half": "float16", "float": "float32"}
_CONVERTERS: dict[str, tuple[Callable[[Any], Any], Any]] = {
    "max_model_len": (_context_len, None),
    "dtype": (lambda text: _DTYPE_ALIASES.get(text, text), None),
    "model_name": (_names, "+"),
    "lora_modules": (_lora_modules, "+"),
    "cors_allowed_origins": (_origins, None),
}


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError("must be a number") from None


_KIND_CONVERTERS = {"int": human_int, "float": _number, "str": str, "dict": _json_object}


# -- the generated flags ---------------------------------------------------------------------


def _options(key: str, kind: str) -> dict[str, Any]:
    names = VLLM_NAMES.get(key, ("--" + key.replace("_", "-"),))
    if kind != "bool":
        return dict.fromkeys(names, _TAKES_VALUE)
    options: dict[str, Any] = {}
    for name in names:
        if name.startswith("--"):
            options[name] = True
            options["--no-" + name[2:]] = False
        else:
            options[name] = True
    return {**options, **_EXTRA_SWITCHES.get(key, {})}


def _engine_flag(knob: Knob) -> Flag:
    kind = knob.kind.replace("dict[str, Any]", "dict")
    convert, nargs = _CONVERTERS.get(knob.name, (_KIND_CONVERTERS.get(kind, str), None))
    group = GROUPS.get(knob.name) or (
        "SchedulerConfig" if knob.name in SCHEDULER_KEYS else "EngineConfig"
    )
    choices = knob.meta.get("choices")
    if knob.name == "dtype" and choices:
        choices = (*choices, *_DTYPE_ALIASES)
    default = knob.meta.get("shown_default") or ("unset" if knob.default is None else knob.default)
    text = knob.meta["doc"].replace("`", "") + f" [{knob.name}; default: {default}]"
    return Flag(
        knob.name, ENGINE, _options(knob.name, kind), group, text, convert, nargs,
        tuple(choices) if choices else None,
    )  # fmt: skip


def _kind(annotation: Any) -> tuple[str, tuple | None]:
    """A ServeArgs field's kind (``int``, ``bool``, ``list``, ``dict``, ...) and choices."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "str", tuple(typing.get_args(annotation))
    if origin is not None and origin not in (list, dict) and args:  # a union with None
        if len(args) == 1:
            return _kind(args[0])
        return "str", None  # e.g. str | list[str]: a converter says
    if origin is list:
        return "list", None
    if origin is dict or (isinstance(annotation, type) and hasattr(annotation, "model_fields")):
        return "dict", None
    return getattr(annotation, "__name__", "str"), None


def _app_flag(name: str, field: Any) -> Flag:
    kind, choices = _kind(field.annotation)
    convert, nargs = _CONVERTERS.get(name, (_KIND_CONVERTERS.get(kind, str), None))
    default = SERVE_DEFAULTS.get(name, field.default)
    if field.default_factory is not None:
        default = field.default_factory()
    default = "unset" if default is None else default
    text = (field.description or "") + f" [{name}; default: {default}]"
    return Flag(name, APP, _options(name, kind), GROUPS.get(name, "Frontend"), text, convert,
                nargs, choices)  # fmt: skip


def _cli_flags() -> list[Flag]:
    """Flags of the command itself (no config key) and vLLM's that convert."""
    t = _TAKES_VALUE
    return [
        Flag("model", ENGINE, {"--model": t}, "ModelConfig",
             "local checkpoint directory, or a Hugging Face hub id already in the local "
             "cache (also the positional MODEL) [model; default: the demo model]"),
        Flag("config", CLI, {"--config": t}, "options",
             "a YAML or JSON file of settings: config keys or these flags' names; a flag "
             "given here wins over the file"),
        Flag("api_key", CLI, {"--api-key": t}, "Frontend",
             "the API key clients must send (Bearer); it stays in this process's "
             "environment (ITERSERVE_API_KEY), never in a config (also: --api-key-env)"),
        Flag("enable_auto_tool_choice", CLI, {"--enable-auto-tool-choice": True}, "Frontend",
             "tool_choice auto (needs --tool-call-parser; without this flag, it is allowed "
             "whenever a parser is set)"),
        Flag("download_dir", CLI, {"--download-dir": t}, "LoadConfig",
             "the Hugging Face cache to find a hub id in (nothing is downloaded)"),
        Flag("log_level", CLI, {"--log-level": t}, "options",
             "debug, info, warning or error; debug also prints a start-up failure's "
             "traceback (else it goes to the log file the message names)",
             choices=("debug", "info", "warning", "error")),
    ]  # fmt: skip


# vLLM's flags that set one of our knobs with a meaning of their own.
DERIVED = [
    Flag("policy", ENGINE, {"--enable-chunked-prefill": "chunked",
                            "--no-enable-chunked-prefill": "continuous"},
         "SchedulerConfig", "vLLM's switch: the chunked policy (--no-: continuous) [policy]"),
]  # fmt: skip


def serve_flags() -> list[Flag]:
    """Every flag of ``iterserve serve``: the command's own, the engine's knobs, the
    ingress's settings, then vLLM's that convert (a key's first flag is its own)."""
    from .app import ServeArgs

    flags = _cli_flags()
    flags += [_engine_flag(k) for k in knobs() if k.name not in _NOT_FLAGS]
    flags += [
        _app_flag(name, field)
        for name, field in ServeArgs.model_fields.items()
        if name not in _NOT_FLAGS
    ]
    return flags + DERIVED


def vllm_only_flags(flags: list[Flag]) -> list[VllmFlag]:
    """vLLM's flags that no generated flag has taken."""
    ours = {option for flag in flags for option in flag.options}
    return [v for v in VLLM_FLAGS if not set(v.names) & ours]


# -- the parser ----------------------------------------------------------------------------


class FlagError(ValueError):
    """A flag, or a config file's key, that cannot be taken; one sentence."""


class _Record(argparse.Action):
    """Records a generated flag's value in ``namespace.given`` under its key; two
    different options setting one key to different values is a contradiction."""

    def __init__(self, option_strings, dest, flag: Flag, **kwargs):
        self.flag = flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            value = self.flag.value(option_string, values)
        except (ValueError, TypeError) as exc:
            shown = " ".join(values) if isinstance(values, list) else values
            parser.error(f"{option_string} {shown}: {exc}")
        given = namespace.__dict__.setdefault("given", {})
        earlier = given.get(self.flag.key)
        if earlier and earlier[1] != option_string and earlier[0] != value:
            parser.error(f"{earlier[1]} and {option_string} contradict each other")
        given[self.flag.key] = (value, option_string)


class _RecordVllm(argparse.Action):
    def __init__(self, option_strings, dest, vllm: VllmFlag, **kwargs):
        self.vllm = vllm
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.__dict__.setdefault("vllm_flags", []).append((option_string, values, self.vllm))


class FlagParser(argparse.ArgumentParser):
    """argparse with vLLM's spellings (``--max_num_seqs`` is ``--max-num-seqs``) and
    an error that is one line, not a usage dump."""

    def parse_known_args(self, args=None, namespace=None):
        if args is not None:
            args = [_dashes(a) for a in args]
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        if message.startswith("unrecognized arguments: "):
            unknown = message.removeprefix("unrecognized arguments: ").split()[0]
            message = (
                f"{unknown} is a flag of neither iterserve nor vLLM's serve "
                f"(`{self.prog} --help` lists them)"
            )
        self.exit(2, f"{self.prog}: {message}\n")


def command_parser(prog: str, usage: str, description: str) -> tuple[FlagParser, list[Flag]]:
    """A command's parser with every generated flag in vLLM's groups (serve's, run-batch's);
    the command adds its own arguments."""
    flags = serve_flags()
    parser = FlagParser(
        prog=prog,
        usage=usage,
        description=description,
        epilog=vllm_epilog(flags),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add_flags(parser, flags)
    return parser, flags


def _dashes(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value


def add_flags(parser: argparse.ArgumentParser, flags: list[Flag]) -> None:
    """The flags in vLLM's help groups, then vLLM's own (listed once, in the epilog)."""
    groups = {"options": parser._optionals}  # argparse's own "options" group
    groups.update({name: parser.add_argument_group(name) for name in GROUP_ORDER[1:]})
    for flag in flags:
        group = groups.get(flag.group) or groups.setdefault(
            flag.group, parser.add_argument_group(flag.group)
        )
        switches = [o for o, c in flag.options.items() if c is not _TAKES_VALUE]
        valued = [o for o, c in flag.options.items() if c is _TAKES_VALUE]
        help_text = flag.help.replace("%", "%%")
        for options, nargs in ((valued, flag.nargs), (switches, 0)):
            if not options:
                continue
            group.add_argument(
                *options, action=_Record, flag=flag, nargs=nargs, default=argparse.SUPPRESS,
                dest=f"{flag.target}.{flag.key}", help=help_text,
                metavar=flag.metavar or (_metavar(flag) if nargs != 0 else None),
            )  # fmt: skip
            help_text = argparse.SUPPRESS  # the switches of a valued flag: one help line
    for vllm in vllm_only_flags(flags):
        nargs = {0: 0, 1: None}.get(vllm.nargs, vllm.nargs)
        parser.add_argument(
            *vllm.names, action=_RecordVllm, vllm=vllm, nargs=nargs, default=argparse.SUPPRESS,
            dest=f"vllm.{vllm.names[0]}", help=argparse.SUPPRESS,
        )  # fmt: skip


def _metavar(flag: Flag) -> str:
    if flag.choices:
        return "{" + ",".join(map(str, flag.choices)) + "}"
    return flag.name.lstrip("-").replace("-", "_").upper()


def vllm_epilog(flags: list[Flag], width: int = 78) -> str:
    """vLLM's flags iterserve accepts with nothing to do, wrapped without breaking a name."""
    import textwrap

    accepted = [
        v.names[0] if v.accepted == "any" else f"{v.names[0]} ({'|'.join(v.accepted)})"
        for v in vllm_only_flags(flags)
        if v.accepted
    ]
    text = (
        "vLLM's other serve flags are accepted with a log line where they tune what "
        f"iterserve does its own way: {', '.join(accepted)}. Any other is refused with "
        "the reason."
    )
    return textwrap.fill(text, width, break_on_hyphens=False, break_long_words=False)


# -- settings: flags over a config file ---------------------------------------------------------


@dataclasses.dataclass
class Setting:
    value: Any
    source: str  # the option, or "config file"
    overridden: Any = None  # the config file's value a flag replaced (None: none)


def vllm_answers(used: list[tuple[str, Any, VllmFlag]]) -> list[str]:
    """Log lines for vLLM's flags that are accepted; raises FlagError for one refused."""
    lines = []
    for option, value, vllm in used:
        shown = option if vllm.nargs == 0 or value is None else f"{option} {_shown(value)}"
        if not vllm.accepts(value):
            raise FlagError(f"{shown}: vLLM's flag is not implemented by iterserve ({vllm.why})")
        lines.append(f"{shown}: accepted, nothing to do: {vllm.why}")
    return lines


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def from_file(data: dict[str, Any], flags: list[Flag]) -> tuple[dict[str, Setting], list]:
    """A config file's settings, keyed as the flags' (config keys, or flag names with or
    without dashes); vLLM's own flags come back apart, as the parser's do."""
    by_key: dict[str, Flag] = {}
    for flag in flags:
        if flag.key != "config":
            by_key.setdefault(flag.key, flag)
    by_option = {o: f for f in flags for o in f.options}
    vllm_by_option = {o: v for v in vllm_only_flags(flags) for o in v.names}
    settings: dict[str, Setting] = {}
    vllm_used = []
    for raw_key, raw in data.items():
        key = str(raw_key).replace("-", "_")
        option = "--" + key.replace("_", "-")
        flag = by_key.get(key) or by_option.get(option)
        if flag is None and option in vllm_by_option:
            vllm = vllm_by_option[option]
            if not (vllm.nargs == 0 and raw is False):  # a switch set false: not given
                vllm_used.append((option, raw, vllm))
            continue
        if flag is None:
            raise FlagError(f"config file: unknown key {raw_key!r}")
        if flag.key == key and option not in flag.options:  # a config key not spelled as a flag
            settings[flag.key] = Setting(raw, "config file")
            continue
        option = option if option in flag.options else flag.name
        if flag.options[option] is not _TAKES_VALUE:  # a switch: true, or false for its opposite
            if not isinstance(raw, bool):
                raise FlagError(f"config file: {raw_key} must be true or false, got {raw!r}")
            if not raw:
                option = _opposite(option)
                if option not in flag.options:
                    continue  # false for a switch without an opposite: not given
        try:
            settings[flag.key] = Setting(flag.value(option, raw), "config file")
        except (ValueError, TypeError) as exc:
            raise FlagError(f"config file: {raw_key}: {exc}") from None
    return settings, vllm_used


def _opposite(option: str) -> str:
    return "--" + option[5:] if option.startswith("--no-") else "--no-" + option[2:]


def merged(file: dict[str, Setting], given: dict[str, tuple[Any, str]]) -> dict[str, Setting]:
    """The flags over the file: a flag wins, and the file's value is kept to show."""
    out = dict(file)
    for key, (value, option) in given.items():
        earlier = file.get(key)
        out[key] = Setting(value, option, earlier.value if earlier else None)
    return out


def startup_line(settings: dict[str, Setting]) -> str:
    """``max_num_seqs=64 (--max-num-seqs; the config file's 32), policy=static (config file)``."""
    parts = []
    for key, s in settings.items():
        if key in ("api_key", "config"):
            continue
        note = s.source
        if s.overridden is not None and s.overridden != s.value:
            note += f"; the config file's {s.overridden!r}"
        parts.append(f"{key}={s.value!r} ({note})")
    return ", ".join(parts)


def split(settings: dict[str, Setting], flags: list[Flag]) -> dict[str, dict[str, Any]]:
    """The settings by where they go: ``{ENGINE: {...}, APP: {...}, CLI: {...}}``."""
    target = {f.key: f.target for f in flags}
    out: dict[str, dict[str, Any]] = {ENGINE: {}, APP: {}, CLI: {}}
    for key, s in settings.items():
        out[target.get(key, ENGINE)][key] = s.value
    return out


def engine_keys() -> set[str]:
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"scheduler"}
    return names | SCHEDULER_KEYS

"""Everything that documents or exposes the engine's knobs, generated from their
declarations (:func:`~iterserve.scheduler.config.knob` in ``cluster/config.py``
and ``scheduler/config.py``): the README's configuration table, and the Helm
chart's ``engine`` values, their schema, their rows in the chart's README and
the template that turns them into the application's ``config``.

``python -m iterserve.cluster.config_docs --write`` rewrites the generated parts
of those files; ``--check`` (and the test suite) fails when any has drifted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Callable
from dataclasses import MISSING
from pathlib import Path
from typing import Any

from ..scheduler.config import SchedulerConfig
from .config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "iterserve"
README_BEGIN = "<!-- config-table: generated from EngineConfig by iterserve.cluster.config_docs -->"
README_END = "<!-- /config-table -->"
FLAGS_BEGIN = "<!-- serve-flags: generated from ServeArgs by iterserve.cluster.config_docs -->"
FLAGS_END = "<!-- /serve-flags -->"
VALUES_BEGIN = (
    "  # (generated from EngineConfig by iterserve.cluster.config_docs: edit the declarations)"
)
TEMPLATE_BEGIN = (
    "{{- /* engine config: generated from EngineConfig by iterserve.cluster.config_docs */}}"
)
TEMPLATE_END = "{{- /* end of the generated engine config */}}"


@dataclasses.dataclass(frozen=True)
class Knob:
    name: str
    kind: str  # int | float | str | bool | dict
    optional: bool
    default: Any
    meta: dict

    @property
    def helm_name(self) -> str:
        head, *rest = self.name.split("_")
        return head + "".join(word.capitalize() for word in rest)

    @property
    def helm_default(self) -> Any:
        value = self.meta.get("helm_default", MISSING)
        value = self.default if value is MISSING else value
        if value is None:  # an optional count: 0 means "derived"; an optional name: ""
            return "" if self.kind == "str" else 0
        return value


def knobs() -> list[Knob]:
    """Every documented field, the scheduler's in the place the engine nests them."""
    out = []
    for f in dataclasses.fields(EngineConfig):
        if f.name == "scheduler":
            out += [_knob(g) for g in dataclasses.fields(SchedulerConfig)]
        elif "doc" in f.metadata:
            out.append(_knob(f))
    return out


def _knob(f: dataclasses.Field) -> Knob:
    text = str(f.type)
    kind = text.removesuffix(" | None").split("[")[0]
    default = {} if f.default is MISSING else f.default
    return Knob(f.name, kind, text.endswith("| None"), default, dict(f.metadata))


# -- README -------------------------------------------------------------------------


def _shown(knob: Knob) -> str:
    if knob.meta.get("shown_default"):
        return knob.meta["shown_default"]
    value = knob.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`"
    if value == {}:
        return "`{}`"
    return str(value)


def _flag_names() -> dict[str, str]:
    """Each setting's ``iterserve serve`` flag (vLLM's name where vLLM has one)."""
    from .serve.flags import serve_flags

    names: dict[str, str] = {}
    for flag in serve_flags():
        names.setdefault(flag.key, flag.name)
    return names


def readme_table() -> str:
    flags = _flag_names()
    rows = ["| key | flag | default | meaning |", "|---|---|---|---|"]
    rows += [f"| `{k.name}` | `{flags[k.name]}` | {_shown(k)} | {k.meta['doc']} |" for k in knobs()]
    return "\n".join(rows)


def serve_flags_table() -> str:
    """The command's flags that are not engine knobs: the ingress's settings
    (ServeArgs, also a Serve config's ``args``) and the command's own."""
    from .serve.flags import CLI, ENGINE, serve_flags

    rows = ["| flag | setting | meaning |", "|---|---|---|"]
    for flag in serve_flags():
        if flag.target == ENGINE and flag.key != "model":
            continue
        options = [o for o in flag.options if not o.startswith("--no-")]
        setting = "(the command's)" if flag.target == CLI else f"`{flag.key}`"
        text = flag.help.split(" [")[0].replace("|", "\\|")
        rows.append(f"| `{'`, `'.join(options)}` | {setting} | {text} |")
    return "\n".join(rows)


# -- the Helm chart --------------------------------------------------------------------

_JSON_TYPES = {"int": "integer", "float": "number", "str": "string", "bool": "boolean"}


def _sentence(doc: str, chart: bool = True) -> str:
    """A declaration's doc as a sentence of the chart's, where an unset optional
    value is written 0."""
    text = doc.replace("`", "")
    if chart:
        text = text.replace("unset:", "0:").replace("is unset", "is 0")
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def _helm_knobs() -> list[Knob]:
    return [k for k in knobs() if k.meta.get("helm", True) and k.kind in _JSON_TYPES]


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return '""'
    return str(value)


def values_block() -> str:
    """The lines of values.yaml's ``engine:`` mapping."""
    lines = [VALUES_BEGIN]
    for k in _helm_knobs():
        lines.append(f"  # -- {_sentence(k.meta['doc'])}")
        lines.append(f"  {k.helm_name}: {_yaml_scalar(k.helm_default)}")
    return "\n".join(lines)


def schema_properties() -> dict:
    props = {}
    for k in _helm_knobs():
        node: dict[str, Any] = {"type": _JSON_TYPES[k.kind]}
        if k.meta.get("choices"):
            node["enum"] = ([""] if k.optional else []) + list(k.meta["choices"])
        if k.optional and k.kind != "str":
            node["minimum"] = 0  # 0: derived
        elif k.meta.get("minimum") is not None:
            node["minimum"] = k.meta["minimum"]
        if k.meta.get("exclusive_minimum") is not None:
            node["exclusiveMinimum"] = k.meta["exclusive_minimum"]
        if k.meta.get("maximum") is not None:
            node["maximum"] = k.meta["maximum"]
        node["description"] = _sentence(k.meta["doc"])
        props[k.helm_name] = node
    return props


def chart_readme_rows() -> list[str]:
    types = {"int": "int", "float": "float", "str": "string", "bool": "bool"}
    return [
        f"| `engine.{k.helm_name}` | {types[k.kind]} | `{json.dumps(k.helm_default)}` | "
        f"{_sentence(k.meta['doc'])} |"
        for k in _helm_knobs()
    ]


def template_block() -> str:
    """The part of the serveConfig template that maps ``engine.*`` to config keys."""
    casts = {"int": "int", "float": "float64"}
    plain = [k for k in _helm_knobs() if not k.optional]
    lines = [TEMPLATE_BEGIN, "{{- $config := dict"]
    for k in plain:
        value = f"$e.{k.helm_name}"
        if k.kind in casts:
            value = f"({casts[k.kind]} {value})"
        lines.append(f'  "{k.name}" {value}')
    lines.append("}}")
    for k in _helm_knobs():
        if k.optional and k.kind == "str":  # "": unset
            lines += [
                f"{{{{- if $e.{k.helm_name} }}}}",
                f'{{{{- $_ := set $config "{k.name}" $e.{k.helm_name} }}}}',
                "{{- end }}",
            ]
        elif k.optional:
            lines += [
                f"{{{{- if gt (int $e.{k.helm_name}) 0 }}}}",
                f'{{{{- $_ := set $config "{k.name}" (int $e.{k.helm_name}) }}}}',
                "{{- end }}",
            ]
    lines.append(TEMPLATE_END)
    return "\n".join(lines)


# -- the files ---------------------------------------------------------------------------


def _between(text: str, begin: str, end: str, body: str, path: Path) -> str:
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"{path}: the generated part's markers are missing")
    return text[:start] + body + text[stop:]


def rendered(read: Callable[[Path], str] = Path.read_text) -> dict[Path, str]:
    """Every generated file as it should read (``read``: each file's text as it is)."""
    out = {}
    readme = ROOT / "README.md"
    text = _between(
        read(readme), README_BEGIN, README_END, f"{README_BEGIN}\n{readme_table()}\n", readme
    )
    out[readme] = _between(
        text, FLAGS_BEGIN, FLAGS_END, f"{FLAGS_BEGIN}\n{serve_flags_table()}\n", readme
    )
    values = CHART / "values.yaml"
    text = read(values)
    out[values] = re.sub(
        r"(?ms)^engine:\n.*?(?=^\S)", lambda _: f"engine:\n{values_block()}\n\n", text, count=1
    )
    schema_path = CHART / "values.schema.json"
    schema = json.loads(read(schema_path))
    schema["properties"]["engine"]["properties"] = schema_properties()
    out[schema_path] = json.dumps(schema, indent=2) + "\n"
    chart_readme = CHART / "README.md"
    lines = read(chart_readme).splitlines()
    rows = [i for i, line in enumerate(lines) if line.startswith("| `engine.")]
    if not rows:
        raise ValueError(f"{chart_readme}: no engine.* rows to replace")
    lines[rows[0] : rows[-1] + 1] = chart_readme_rows()
    out[chart_readme] = "\n".join(lines) + "\n"
    helpers = CHART / "templates" / "_helpers.tpl"
    text = read(helpers)
    out[helpers] = _between(
        text, TEMPLATE_BEGIN, TEMPLATE_END, template_block().removesuffix(TEMPLATE_END), helpers
    )
    return out


def stale() -> list[Path]:
    return [path for path, text in rendered().items() if path.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m iterserve.cluster.config_docs")
    parser.add_argument("--write", action="store_true", help="rewrite the generated parts")
    parser.add_argument("--check", action="store_true", help="exit 1 when any has drifted")
    args = parser.parse_args(argv)
    if args.write:
        for path, text in rendered().items():
            path.write_text(text)
        return 0
    drifted = stale()
    for path in drifted:
        print(f"{path.relative_to(ROOT)} differs from EngineConfig's declarations", file=sys.stderr)
    return 1 if drifted and args.check else 0


if __name__ == "__main__":
    sys.exit(main())

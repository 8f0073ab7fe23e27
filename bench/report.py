"""Latency and throughput figures shared by the load generator and the policy benchmark.

Every run is reduced to one :class:`RequestTiming` per request: when it was sent
and when each of its outputs arrived (an output may carry several tokens), all
in seconds on one monotonic clock. The figures follow the usual serving
definitions::

    sent ──── TTFT ────▶ first token ── ITL ──▶ token ── ITL ──▶ ... last token
    ◀──────────────────────────── E2E ──────────────────────────────────▶
    TPOT = (E2E - TTFT) / (output tokens - 1)

ITL is one value per token after the first: an output that brings ``n`` tokens
``gap`` seconds after the previous one counts as ``n`` tokens of ``gap / n``
(the same convention as the engine's own ITL histogram).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field

QUANTILES = (50, 90, 99)


@dataclass
class RequestTiming:
    sent_s: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, tokens)
    error: str | None = None  # an HTTP status or exception name; None: it succeeded

    def add(self, t: float, num_tokens: int) -> None:
        if num_tokens > 0:
            self.chunks.append((t, num_tokens))

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft_s(self) -> float | None:
        return self.chunks[0][0] - self.sent_s if self.chunks else None

    @property
    def e2e_s(self) -> float | None:
        return self.chunks[-1][0] - self.sent_s if self.chunks else None

    @property
    def tpot_s(self) -> float | None:
        if self.num_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_tokens - 1)

    def itl_s(self) -> list[float]:
        out: list[float] = []
        for (prev, _), (t, n) in zip(self.chunks, self.chunks[1:]):
            out.extend([(t - prev) / n] * n)
        return out


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _quantiles(name: str, values: list[float]) -> dict[str, float | None]:
    out = {f"{name}_p{q}_s": _round(percentile(values, q)) for q in QUANTILES}
    out[f"{name}_mean_s"] = _round(sum(values) / len(values)) if values else None
    return out


def _round(x: float | None, digits: int = 5) -> float | None:
    return None if x is None else round(x, digits)


def summarize(
    timings: list[RequestTiming],
    makespan_s: float,
    *,
    slo_ttft_s: float | None = None,
    slo_itl_s: float | None = None,
) -> dict:
    """Percentiles of TTFT / ITL / TPOT / E2E over successful requests, request and
    token throughput over ``makespan_s``, and goodput: requests per second whose TTFT
    and p99 ITL both meet the SLOs (an SLO left as None always holds)."""
    done = [t for t in timings if t.error is None and t.chunks]
    itl = [gap for t in done for gap in t.itl_s()]
    num_tokens = sum(t.num_tokens for t in done)
    good = [
        t
        for t in done
        if (slo_ttft_s is None or t.ttft_s <= slo_ttft_s)
        and (slo_itl_s is None or (percentile(t.itl_s(), 99) or 0.0) <= slo_itl_s)
    ]
    span = max(makespan_s, 1e-9)
    result = {
        "num_requests": len(timings),
        "num_completed": len(done),
        "num_errors": len(timings) - len(done),
        "num_output_tokens": num_tokens,
        "makespan_s": _round(makespan_s, 3),
        "request_throughput_req_s": _round(len(done) / span, 3),
        "throughput_tok_s": _round(num_tokens / span, 2),
        "goodput_req_s": _round(len(good) / span, 3),
    }
    result.update(_quantiles("ttft", [t.ttft_s for t in done]))
    result.update(_quantiles("itl", itl))
    result.update(_quantiles("tpot", [t.tpot_s for t in done if t.tpot_s is not None]))
    result.update(_quantiles("e2e", [t.e2e_s for t in done]))
    return result


def prometheus_values(text: str | bytes) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted non-base labels): value}`` from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    if isinstance(text, bytes):
        text = text.decode()
    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(
                sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))
            )
            out[s.name, labels] = out.get((s.name, labels), 0.0) + s.value
    return out


def step_figures(before: dict, after: dict, max_num_seqs: int) -> dict:
    """Slot utilization and padding from two snapshots of an engine's metrics.

    slot_utilization = live sequences summed over steps ÷ (slots × steps): a
    static batch's finished members still take a slot (computed as padding) but
    are not live, which is exactly the first-finisher waste.
    padding_fraction = padding tokens ÷ every token computed (prefill + decode + padding).
    """

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    steps = delta("iterserve_step_running_sequences_count")
    step_s = delta("iterserve_step_duration_seconds_sum")
    live = delta("iterserve_step_running_sequences_sum")
    padding = delta("iterserve_padding_tokens_total")
    prefill = delta("iterserve_step_tokens_sum", kind="prefill")
    decode = delta("iterserve_step_tokens_sum", kind="decode")
    computed = padding + prefill + decode
    return {
        "num_steps": int(steps),
        "step_ms_mean": _round(1000 * step_s / steps if steps else 0.0, 2),
        "slot_utilization": _round(live / (max_num_seqs * steps) if steps else 0.0, 4),
        "padding_fraction": _round(padding / computed if computed else 0.0, 4),
        "num_padding_tokens": int(padding),
        "num_prefill_tokens": int(prefill),
        "num_decode_tokens": int(decode),
    }


def forward_ms_per_step(before: dict, after: dict) -> float:
    """The rank's own ms in the model per step between two ``stats()["timing"]``
    snapshots of an engine; the rest of a step's time is the control plane."""
    steps = after["steps"] - before["steps"]
    return 1000 * (after["forward_s"] - before["forward_s"]) / steps if steps else 0.0


def format_table(rows: dict[str, dict], columns: list[tuple[str, str, str]]) -> str:
    """A plain-text table: one row per name; ``columns`` are (key, header, format)."""
    header = ["", *[h for _, h, _ in columns]]
    lines = [header]
    for name, metrics in rows.items():
        cells = [name]
        for key, _, fmt in columns:
            value = metrics.get(key)
            cells.append("-" if value is None else format(value, fmt))
        lines.append(cells)
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(line, widths))
        )
        for line in lines
    )


# -- the policy comparison's entries, table and targets ---------------------------------------

POLICY_TABLE = [
    ("throughput_tok_s", "tok/s", ".1f"),
    ("slot_utilization", "slot util", ".3f"),
    ("padding_fraction", "padding", ".3f"),
    ("ttft_p50_s", "TTFT p50", ".3f"),
    ("ttft_p99_s", "TTFT p99", ".3f"),
    ("itl_p99_s", "ITL p99", ".3f"),
    ("stream_itl_p50_s", "stream ITL p50", ".3f"),
    ("stream_itl_p99_s", "stream ITL p99", ".3f"),
    ("e2e_p50_s", "E2E p50", ".2f"),
    ("e2e_p99_s", "E2E p99", ".2f"),
    ("num_steps", "steps", "d"),
    ("step_ms_mean", "ms/step", ".1f"),
    ("forward_ms_mean", "fwd ms", ".1f"),
]
_LATENCY_PREFIXES = ("ttft_", "itl_", "tpot_", "e2e_")


def policy_entry(
    kinds: list[str], timings: list[RequestTiming], makespan_s: float, steps: dict
) -> dict:
    """One column of the comparison: headline figures, then a breakdown by request
    kind (``kinds[i]`` is request i's) when the workload mixes kinds."""
    total = summarize(timings, makespan_s)
    entry = {k: total[k] for k in ("throughput_tok_s", "num_output_tokens", "makespan_s")}
    entry.update({k: steps[k] for k in ("slot_utilization", "padding_fraction", "num_steps")})
    entry.update({k: v for k, v in total.items() if k.startswith(_LATENCY_PREFIXES)})
    if len(set(kinds)) > 1:
        for kind in sorted(set(kinds)):
            part = summarize([t for k, t in zip(kinds, timings) if k == kind], makespan_s)
            for key in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p99_s"):
                entry[f"{kind}_{key}"] = part[key]
    entry.update({k: v for k, v in steps.items() if k not in entry})
    entry["num_errors"] = total["num_errors"]
    return entry


def median_entry(entries: list[dict]) -> dict:
    """Per-figure median over repeated runs of one policy; the throughputs of every run
    are kept too, so their spread is visible."""
    if len(entries) == 1:
        return entries[0]
    out = {}
    for key, value in entries[0].items():
        values = [e.get(key) for e in entries]
        if isinstance(value, (int, float)) and all(isinstance(v, (int, float)) for v in values):
            mid = statistics.median(values)
            out[key] = type(value)(mid) if isinstance(value, int) else round(mid, 5)
        else:
            out[key] = value
    out["repeats"] = len(entries)
    out["throughput_tok_s_runs"] = [e["throughput_tok_s"] for e in entries]
    return out


def _ratio(result: dict, a: str, b: str, key: str) -> float | None:
    """``a``'s ``key`` ÷ ``b``'s; a name is a policy or ``hf_generate``."""
    entries = {**result.get("policies", {}), "hf_generate": result.get("hf_generate")}
    x, y = (entries.get(a) or {}).get(key), (entries.get(b) or {}).get(key)
    return round(x / y, 3) if x is not None and y else None


def targets(workload: str, result: dict) -> list[dict]:
    """The comparison's figures against the targets it was designed to show."""
    get = lambda name, key: (result["policies"].get(name) or {}).get(key)  # noqa: E731
    if workload == "longtail":
        rows = [
            (
                "continuous / static throughput",
                _ratio(result, "continuous", "static", "throughput_tok_s"),
                ">= 3",
                lambda v: v >= 3,
            ),
            (
                "continuous slot utilization",
                get("continuous", "slot_utilization"),
                ">= 0.85",
                lambda v: v >= 0.85,
            ),
            (
                "static slot utilization",
                get("static", "slot_utilization"),
                "<= 0.35",
                lambda v: v <= 0.35,
            ),
            (
                "static / continuous E2E p99",
                _ratio(result, "static", "continuous", "e2e_p99_s"),
                ">= 3",
                lambda v: v >= 3,
            ),
            (
                "continuous / hf_generate throughput",
                _ratio(result, "continuous", "hf_generate", "throughput_tok_s"),
                ">= 3",
                lambda v: v >= 3,
            ),
        ]
    else:
        rows = [
            ("continuous / chunked stream ITL p99", _ratio(result, "continuous", "chunked", "stream_itl_p99_s"), ">= 3", lambda v: v >= 3),
            ("chunked / continuous throughput", _ratio(result, "chunked", "continuous", "throughput_tok_s"), "0.9 .. 1.1", lambda v: abs(v - 1) <= 0.1),
        ]  # fmt: skip
    return [
        {"name": name, "value": value, "target": target, "met": bool(ok(value))}
        for name, value, target, ok in rows
        if value is not None
    ]


def render_policies(result: dict) -> str:
    rows = dict(result["policies"])
    if result.get("hf_generate"):
        rows["hf_generate"] = result["hf_generate"]
    columns = [c for c in POLICY_TABLE if any(m.get(c[0]) is not None for m in rows.values())]
    lines = [format_table(rows, columns), ""]
    for t in result.get("targets", []):
        lines.append(
            f"{t['name']}: {t['value']} (target {t['target']}) {'met' if t['met'] else 'MISSED'}"
        )
    return "\n".join(lines)


def write_json(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")

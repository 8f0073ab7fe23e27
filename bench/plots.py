"""PNG figures of the benchmarks (matplotlib, a dev dependency, imported only here)."""

from __future__ import annotations

from .report import RequestTiming

COLORS = {"static": "#c44e52", "dynamic": "#dd8452", "continuous": "#4c72b0",
          "chunked": "#55a868", "hf_generate": "#8172b3"}  # fmt: skip


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values: list[float], label: str) -> None:
    if not values:
        return
    xs = sorted(values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def loadgen_plot(result: dict, timings: list[list[RequestTiming]], path: str) -> None:
    """One run: CDFs of TTFT, ITL and E2E. A sweep: throughput and p99 latencies vs rate."""
    plt = _pyplot()
    runs = result["runs"]
    if len(runs) == 1:
        fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
        done = [t for t in timings[0] if t.error is None and t.chunks]
        series = {
            "TTFT": [t.ttft_s for t in done],
            "ITL": [gap for t in done for gap in t.itl_s()],
            "E2E": [t.e2e_s for t in done],
        }
        for ax, (name, values) in zip(axes, series.items()):
            _cdf(ax, values, name)
            ax.set_xlabel(f"{name} (s)")
            ax.set_ylim(0, 1.01)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("fraction of requests / tokens")
        fig.suptitle(f"bench serve: {runs[0]['request_rate']} req/s")
    else:
        fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
        rates = [r["request_rate"] for r in runs]
        left.plot(rates, [r["throughput_tok_s"] for r in runs], "o-", label="output tok/s")
        left.set_xlabel("request rate (req/s)")
        left.set_ylabel("output tokens/s")
        for name in ("ttft", "itl", "e2e"):
            right.plot(rates, [r[f"{name}_p99_s"] for r in runs], "o-", label=f"{name.upper()} p99")
        right.set_xlabel("request rate (req/s)")
        right.set_ylabel("seconds")
        right.set_yscale("log")
        right.legend()
        for ax in (left, right):
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def policy_plot(result: dict, path: str) -> None:
    """Bars per policy (and hf_generate): throughput, slot utilization, p99 latency."""
    plt = _pyplot()
    rows = dict(result["policies"])
    if result.get("hf_generate"):
        rows["hf_generate"] = result["hf_generate"]
    long_prompts = result["workload"]["name"] == "long-prompts"
    latency_key = "stream_itl_p99_s" if long_prompts else "e2e_p99_s"
    panels = [
        ("throughput_tok_s", "output tokens/s"),
        ("slot_utilization", "slot utilization"),
        (latency_key, "stream ITL p99 (s)" if long_prompts else "E2E p99 (s)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 3.2))
    names = list(rows)
    for ax, (key, label) in zip(axes, panels):
        values = [rows[n].get(key) or 0.0 for n in names]
        ax.bar(range(len(names)), values, color=[COLORS.get(n, "#999999") for n in names])
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
        for x, v in enumerate(values):
            text = f"{v:.0f}" if v >= 100 else f"{v:.3g}"  # 1859, not 1.86e+03
            ax.annotate(text, (x, v), ha="center", va="bottom", fontsize=8)
    fig.suptitle(f"bench policies --workload {result['workload']['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)

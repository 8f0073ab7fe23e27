"""``bench compare`` sends each round prompts of its own, the same to both servers,
so that no server answers a later round from its prefix cache; a ratio over a
median of 0 is None, not a division error."""

from __future__ import annotations

import argparse

from iterserve.bench import compare
from iterserve.models import DEMO_MODEL_PATH


def test_each_round_has_its_own_prompts_and_both_servers_get_them(monkeypatch, tmp_path):
    sent: list[tuple[str, list]] = []

    def fake_run(server, items, warmup, concurrency):
        sent.append((server.name, [item.prompt for item in items]))
        return {key: 1.0 for key, _, _ in compare.METRICS}

    monkeypatch.setattr(compare, "one_run", fake_run)
    parser = argparse.ArgumentParser()
    compare.register(parser.add_subparsers())
    args = parser.parse_args([
        "compare", "--a-url", "http://127.0.0.1:1", "--a-model", "m", "--b-url",
        "http://127.0.0.1:2", "--b-model", "m", "--b-name", "other", "--num-prompts", "3",
        "--input-len", "4", "--output-len", "2", "--rounds", "3",
        "--tokenizer", str(DEMO_MODEL_PATH), "--json", str(tmp_path / "out.json"),
    ])  # fmt: skip
    args.func(args)
    by_round = [sent[i : i + 2] for i in range(0, len(sent), 2)]
    assert len(by_round) == 3
    for (first, prompts), (second, again) in by_round:
        assert {first, second} == {"iterserve", "other"} and prompts == again
    rounds = [prompts for (_, prompts), _ in by_round]
    assert all(rounds[i] != rounds[j] for i in range(3) for j in range(i + 1, 3))


def test_a_ratio_over_a_zero_median_is_none():
    a = compare.Server("a", "http://a", "m")
    b = compare.Server("b", "http://b", "m")
    a.runs = [dict.fromkeys((k for k, _, _ in compare.METRICS), 2.0) for _ in range(3)]
    b.runs = [{**run, "itl_p50_s": 0.0} for run in a.runs]  # tokens read several at once
    ratios = compare.summarize_servers(a, b)["ratios_a_over_b"]
    assert ratios["itl_p50_s"] is None
    assert {k: v for k, v in ratios.items() if k != "itl_p50_s"} == dict.fromkeys(
        (k for k, _, _ in compare.METRICS if k != "itl_p50_s"), 1.0
    )

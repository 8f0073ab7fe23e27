"""``iterserve bench compare`` runs one workload against two servers in alternating
rounds and reports both, with their ratios (here: one server twice)."""

from __future__ import annotations

import argparse
import json

import pytest

from iterserve.bench import compare
from tests.serve.conftest import deploy, fake_engine, undeploy


@pytest.fixture(scope="module")
def bench_url(serve_url, tokenizer_dir, vocab_size):
    config = fake_engine(vocab_size, executor_options={"output_len": None})
    yield deploy(serve_url, "compare", model=str(tokenizer_dir), config=config)
    undeploy("compare")


def test_compare_reports_both_servers_medians_and_ratios(bench_url, tokenizer_dir, tmp_path):
    parser = argparse.ArgumentParser()
    compare.register(parser.add_subparsers())
    out = tmp_path / "compare.json"
    args = parser.parse_args([
        "compare", "--a-url", bench_url, "--a-model", "tiny-chat", "--b-url", bench_url,
        "--b-model", "tiny-chat", "--b-name", "again", "--num-prompts", "6", "--input-len", "4",
        "--output-len", "5", "--warmups", "1", "--rounds", "2", "--tokenizer", str(tokenizer_dir),
        "--json", str(out), "--png", str(tmp_path / "compare.png"),
    ])  # fmt: skip
    args.func(args)
    result = json.loads(out.read_text())
    for name in ("iterserve", "again"):
        server = result["servers"][name]
        assert len(server["rounds"]) == 2
        assert all(
            r["num_output_tokens"] == 6 * 5 and r["num_errors"] == 0 for r in server["rounds"]
        )
        assert server["throughput_tok_s"] > 0 and server["ttft_p50_s"] > 0
    ratios = result["ratios_a_over_b"]
    assert set(ratios) == {k for k, _, _ in compare.METRICS}
    assert ratios["throughput_tok_s"] > 0 and ratios["ttft_p50_s"] > 0
    # The stand-in is fast enough for the client to read several tokens in one chunk,
    # so an ITL median can be 0: that ratio is then None (summarize_servers's test).
    assert all(v is None or v > 0 for v in ratios.values())
    assert (tmp_path / "compare.png").stat().st_size > 0

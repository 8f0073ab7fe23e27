"""The real test: Prometheus scrapes a live server under load, and every panel query
of every dashboard returns data through Prometheus' HTTP API."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from tests.observability.prom import PROMETHEUS, all_panel_queries, query, run_prometheus, wait_for
from tests.serve.conftest import deploy, fake_engine, undeploy

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is not installed")
APP = "observed"


async def _load(base_url: str, models: list[str], seconds: float) -> None:
    """Streams and plain requests, some abandoned part-way (aborts), for ``seconds``,
    each on one of ``models`` (the base model, a LoRA adapter)."""
    rng = random.Random(0)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds

    async def one(client: httpx.AsyncClient) -> None:
        body = {
            "model": rng.choice(models),
            "prompt": [5, 6, 7, 8],
            "max_tokens": rng.randint(4, 24),
            "stream": True,
        }
        async with client.stream("POST", "/v1/completions", json=body) as response:
            quit_after = rng.choice([None, None, 2])
            async for i, _line in _enumerate(response.aiter_lines()):
                if quit_after is not None and i >= quit_after:
                    break

    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        while loop.time() < deadline:
            await asyncio.gather(*(one(client) for _ in range(8)))


async def _enumerate(ait):
    i = 0
    async for item in ait:
        yield i, item
        i += 1


def test_every_panel_query_returns_data_from_a_live_server(
    serve_url, tokenizer_dir, vocab_size, tmp_path
):
    # A LoRA adapter too, so that the adapter panels have series (the stand-in model
    # reads only its config).
    adapter = tmp_path / "observed-lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    config = fake_engine(vocab_size, executor_options={"step_sleep_s": 0.005},
                         lora_modules={"observed-lora": str(adapter)})  # fmt: skip
    base_url = deploy(
        serve_url, APP, model=str(tokenizer_dir), config=config, model_name="observed-model"
    )
    try:
        host_port = serve_url.removeprefix("http://")
        with run_prometheus(host_port, metrics_path=f"/{APP}/metrics") as prom:
            asyncio.run(_load(base_url, ["observed-model", "observed-lora"], seconds=12.0))
            # Two scrapes after the load so every rate() window holds an increase.
            assert wait_for(lambda: query(prom, "iterserve_generation_tokens_total"), 30)
            queries = all_panel_queries()
            assert queries
            empty = []
            for dashboard, title, expr in queries:
                result = wait_for(lambda e=expr: query(prom, e), timeout_s=20)
                if not result:
                    empty.append(f"{dashboard} / {title}: {expr}")
            assert not empty, "panel queries without data:\n" + "\n".join(empty)
    finally:
        undeploy(APP)

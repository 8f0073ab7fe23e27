"""The KV tiers through the real server on a tiny real Llama: prompts served before
a restart come back from the disk tier after it (``usage.prompt_tokens_details
.cached_tokens`` counts them), with the same greedy text; ``POST
/reset_prefix_cache`` (vLLM's endpoint) needs the API key and with
``reset_external=true`` empties the host and disk tiers too."""

from __future__ import annotations

import time

import httpx

from tests.serve.conftest import API_KEY, AUTH, deploy, tiny_model_engine, undeploy

APP = "kvtiers"
PROMPTS = [f"{word} " * 15 for word in ("alpha", "beta", "gamma")]


def _config(disk_dir) -> dict:
    return tiny_model_engine(
        kv_offloading_size=0.01, kv_disk_cache_dir=str(disk_dir), kv_disk_cache_size=0.05
    )


def _complete(http: httpx.Client, prompt: str) -> tuple[str, int]:
    r = http.post("/v1/completions", headers=AUTH, json={
        "model": "tiny-llama", "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True,
    })  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    details = body["usage"].get("prompt_tokens_details") or {}
    return body["choices"][0]["text"], details.get("cached_tokens", 0)


def _serve_once(serve_url, model_dir, disk_dir) -> tuple[list, dict]:
    url = deploy(serve_url, APP, model=str(model_dir), config=_config(disk_dir), api_key=API_KEY)
    try:
        with httpx.Client(base_url=url, timeout=120) as http:
            answers = [_complete(http, p) for p in PROMPTS]
            stats = http.get("/v1/stats", headers=AUTH).json()
            for _ in range(50):  # the writer runs in the background
                if any(disk_dir.rglob("*.kv")):
                    break
                time.sleep(0.1)
            else:
                raise AssertionError(f"nothing was written to the disk tier: {stats}")
            return answers, stats
    finally:
        undeploy(APP)


def test_prompts_come_back_from_disk_after_a_restart(serve_url, tiny_model_dir, tmp_path):
    first, _ = _serve_once(serve_url, tiny_model_dir, tmp_path)
    time.sleep(1.0)  # the writer's files land before the replica goes
    second, stats = _serve_once(serve_url, tiny_model_dir, tmp_path)
    for (text1, cached1), (text2, cached2) in zip(first, second):
        assert text2 == text1
        assert cached2 > cached1 and cached2 >= 32
    engine = stats["replicas"][0]
    assert "kv_block_hash" in str(engine)


def test_reset_prefix_cache_needs_the_key_and_empties_every_tier(
    serve_url, tiny_model_dir, tmp_path
):
    url = deploy(serve_url, APP, model=str(tiny_model_dir), config=_config(tmp_path),
                 api_key=API_KEY)  # fmt: skip
    try:
        with httpx.Client(base_url=url, timeout=120) as http:
            _complete(http, PROMPTS[0])
            assert http.post("/reset_prefix_cache").status_code == 401
            bad = http.post("/reset_prefix_cache?reset_external=maybe", headers=AUTH)
            assert bad.status_code == 400 and "reset_external" in bad.text
            r = http.post("/reset_prefix_cache?reset_external=true", headers=AUTH)
            assert r.status_code == 200 and r.json()["success"] is True
            _, cached = _complete(http, PROMPTS[0])
            assert cached == 0
    finally:
        undeploy(APP)

"""Every supported architecture through the whole engine, equal to transformers.

Each tiny checkpoint (tests/workers/tiny_checkpoints.py) is served by the
offline API (``LLM``) and by the OpenAI server, under chunked prefill with an
odd token budget and a KV cache small enough that sequences are preempted and
recomputed; greedy tokens must be transformers' own, token for token. Gemma 3
(dense) and Qwen3-MoE also run on two tensor-parallel ranks.
"""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest

from iterserve.scheduler import SamplingParams
from iterserve.scheduler.config import CONTEXT_CAP
from tests.workers.tiny_checkpoints import HFReference, build_hf_model, save

ARCHS = ["mistral", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3", "phi3"]
# Long enough to pass every window (20..40) while decoding.
PROMPTS = [[3 + (11 * i + 5 * j) % 250 for j in range(n)] for i, n in enumerate([3, 9, 17, 30, 45, 60])]  # fmt: skip
MAX_TOKENS = 24
ENGINE = dict(
    dtype="float32",
    policy="chunked",
    max_num_batched_tokens=37,  # odd: pieces end mid-block
    max_num_seqs=4,
    block_size=4,
    max_model_len=96,
    num_kv_blocks=24,  # one sequence's worth: four at once must preempt
    num_cpus_per_worker=0.1,
    torch_threads=1,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer_dir):
    """name -> (checkpoint directory with a tokenizer, transformers' greedy tokens)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            model = build_hf_model(name)
            path = save(model, tmp_path_factory.mktemp("arch") / name)
            for file in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(tokenizer_dir / file, path / file)
            hf = HFReference(model)
            cache[name] = (path, [hf.greedy(prompt, MAX_TOKENS) for prompt in PROMPTS])
        return cache[name]

    return get


def _offline(path, **overrides):
    from iterserve.cluster.engine import LLM
    from tests.cluster.conftest import assert_sound

    llm = LLM(model=str(path), **{**ENGINE, **overrides})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params)
        # Idle again: no slot or block held, the allocators' own check passed.
        stats = llm.loop.run_until_complete(assert_sound(llm.engine))
    finally:
        llm.shutdown()
    return outputs, stats


@pytest.mark.parametrize("name", ARCHS)
def test_offline_api_matches_transformers(name, served):
    path, expected = served(name)
    outputs, stats = _offline(path)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)
    assert stats["num_preemptions"] > 0, "the cache was sized for preemption"
    assert stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("name", ["gemma3", "qwen3_moe"])
def test_offline_api_on_two_tensor_parallel_ranks(name, served):
    path, expected = served(name)
    outputs, _ = _offline(path, tensor_parallel_size=2)
    assert [o.token_ids for o in outputs] == expected


@pytest.mark.parametrize(("original", "tp"), [(32, 1), (32, 2), (CONTEXT_CAP, 2)])
def test_longrope_takes_the_factors_of_the_context_the_engine_resolves(
    original, tp, tmp_path_factory, tokenizer_dir
):
    """Phi-3 with its original positions stretched four times, max_model_len unset. 32
    stretched to 128: the engine serves the checkpoint's 128 and every rank takes the
    long factors, transformers' numbers for prompts past 32 tokens. 4096 stretched
    to 16384: the engine serves CONTEXT_CAP (4096), within the original, and every
    rank takes the short factors, transformers' numbers for the shorter prompts."""
    model = build_hf_model("phi3", max_position_embeddings=4 * original,
                           original_max_position_embeddings=original)  # fmt: skip
    path = save(model, tmp_path_factory.mktemp("arch") / f"phi3-{original}")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / file, path / file)
    prompts = [p for p in PROMPTS if len(p) > 32] if original == 32 else PROMPTS
    from iterserve.cluster.engine import LLM

    llm = LLM(model=str(path), **{**ENGINE, "max_model_len": None, "num_kv_blocks": 1100},
              tensor_parallel_size=tp)  # fmt: skip
    try:
        assert llm.engine.max_model_len == min(4 * original, CONTEXT_CAP)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    hf = HFReference(model)
    assert [o.token_ids for o in outputs] == [hf.greedy(p, MAX_TOKENS) for p in prompts]


async def _complete_all(url: str, model: str) -> tuple[list[list[int]], dict]:
    """Every prompt at once over HTTP: the generated token ids of each, and the stats."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def complete(prompt):
            body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True, "logprobs": 0,
                    "return_tokens_as_token_ids": True}  # fmt: skip
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            tokens = r.json()["choices"][0]["logprobs"]["tokens"]
            return [int(t.removeprefix("token_id:")) for t in tokens]

        got = await asyncio.gather(*(complete(p) for p in PROMPTS))
        return list(got), (await client.get("/v1/stats")).json()


@pytest.mark.parametrize("name", ARCHS)
def test_server_matches_transformers(name, served, serve_url):
    from tests.serve.conftest import deploy, undeploy

    path, expected = served(name)
    app = f"arch-{name}"
    url = deploy(serve_url, app, model=str(path), config={**ENGINE, "kernel_backend": "cpu"})
    try:
        # Preemption needs the long prompts decoding at once; how many of the six
        # requests overlap depends on when each reaches the engine, so the round
        # is repeated (at most three times) until one has preempted.
        for _ in range(3):
            got, stats = asyncio.run(_complete_all(url, name))
            assert got == expected
            if stats["num_preemptions"] > 0:
                break
    finally:
        undeploy(app)
    assert stats["num_preemptions"] > 0

"""Every rank of an engine computes alike: what changes numerics (here the dtype,
which the first rank measures at the avx512_bf16 level) is decided once and handed
to every rank, so ranks whose own timings disagree serve the tokens ranks whose
timings agree serve."""

from __future__ import annotations

import pytest

from iterserve.cluster.engine.api import AsyncEngine
from iterserve.kernels.cpu import isa
from tests.cluster.conftest import GREEDY, PROMPTS, collect_all, model_config
from tests.cluster.timings import RankTimings

pytestmark = [
    pytest.mark.usefixtures("ray_session"),
    pytest.mark.skipif(
        not isa.at_least(isa.hardware(), "avx512_bf16"),
        reason="the CPU has no avx512_bf16 to cap at",
    ),  # fmt: skip
]


async def _serve(path: str, ratios: tuple[float, ...]) -> tuple[list, dict]:
    config = model_config(path, tensor_parallel_size=2, dtype="auto")
    engine = await AsyncEngine(config, RankTimings(ratios=ratios)).start()
    try:
        results = await collect_all(engine, PROMPTS, GREEDY)
        return [tokens for tokens, _ in results], engine.info
    finally:
        await engine.shutdown()


async def test_ranks_whose_timings_disagree_serve_what_agreeing_ranks_serve(tiny_llama):
    agreeing, info = await _serve(tiny_llama, (0.5, 0.5))
    assert info["dtype"] == "bfloat16" and "measured at load" in info["dtype_reason"]
    disagreeing, info = await _serve(tiny_llama, (0.5, 2.0))  # rank 1 alone: fp32
    assert info["dtype"] == "bfloat16"
    assert disagreeing == agreeing
    slower, info = await _serve(tiny_llama, (2.0, 0.5))  # rank 0 decides: fp32 for both
    assert info["dtype"] == "float32" and len(slower) == len(agreeing)

"""The ingress's grammar check: a child process it kills when a compile overruns."""

from __future__ import annotations

import json

import pytest

from iterserve.cluster.openai.errors import APIError
from iterserve.cluster.openai.structured import GrammarValidator
from iterserve.models import DEMO_MODEL_PATH
from iterserve.scheduler.sampling import StructuredOutput

# Two thousand optional properties: xgrammar takes minutes to compile it.
SLOW = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}


async def test_a_compile_that_overruns_is_refused_and_the_next_check_still_works():
    validator = GrammarValidator(DEMO_MODEL_PATH, timeout_s=1.0)
    try:
        with pytest.raises(APIError, match="takes longer than 1 s to compile") as info:
            await validator.check("guided_json", StructuredOutput("json", json.dumps(SLOW)), 4096)
        assert info.value.status == 400 and info.value.param == "guided_json"
        first = validator._proc
        assert first is None  # killed; the next check starts a fresh one
        await validator.check("guided_regex", StructuredOutput("regex", "[a-z]+"), 4096)
        with pytest.raises(APIError, match="does not compile"):
            await validator.check("guided_regex", StructuredOutput("regex", "a("), 4096)
        # The verdict is remembered: no second minute of compiling.
        with pytest.raises(APIError, match="takes longer"):
            await validator.check("guided_json", StructuredOutput("json", json.dumps(SLOW)), 4096)
    finally:
        validator.close()


async def test_a_checker_that_cannot_start_is_a_503_not_a_crash(tmp_path):
    validator = GrammarValidator(tmp_path / "no-tokenizer-here")
    with pytest.raises(APIError, match="structured outputs are unavailable") as info:
        await validator.check("guided_regex", StructuredOutput("regex", "a"), 4096)
    assert info.value.status == 503 and "Retry-After" in info.value.headers

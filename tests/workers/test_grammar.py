"""Structured outputs on the runner, without Ray: the bitmask, and each matcher's
life (it advances with every sampled token, and is rebuilt from the tokens a
sequence carries after a preemption or on a restarted worker)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from plan_driver import PlanDriver

from iterserve.models import DEMO_MODEL_PATH
from iterserve.scheduler.messages import NewSequence, ScheduledSeq, StepPlan
from iterserve.scheduler.sampling import SamplingParams, StructuredOutput
from iterserve.scheduler.seq_table import SeqState
from iterserve.workers import ModelRunner
from iterserve.workers.grammar import (
    GrammarChecker,
    GrammarError,
    GrammarMask,
    Grammars,
    apply_token_bitmask,
    tokenizer_info,
)
from iterserve.workers.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "year": {"type": "integer", "minimum": 1990, "maximum": 2030},
        "tags": {"type": "array", "items": {"enum": ["py", "c", "go"]}, "maxItems": 3},
    },
    "required": ["name", "year", "tags"],
}
JSON = StructuredOutput("json", json.dumps(SCHEMA))
REGEX = StructuredOutput("regex", r"(yes|no), because [a-z ]{3,20}\.")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(DEMO_MODEL_PATH)


def runner(seed: int = 0) -> ModelRunner:
    return ModelRunner(DEMO_MODEL_PATH, dtype="float32", num_kv_blocks=256, block_size=4,
                       kernel_backend="torch", seed=seed)  # fmt: skip


def params(structured: StructuredOutput, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 80, **kwargs},
                          structured_output=structured)  # fmt: skip


def check_json(tok: Tokenizer, output: list[int]) -> dict:
    assert output[-1] in tok.eos_token_ids, "a grammar ends its sequence with EOS"
    value = json.loads(tok.decode(output))
    assert set(value) == {"name", "year", "tags"} and 1990 <= value["year"] <= 2030
    assert len(value["name"]) <= 12 and set(value["tags"]) <= {"py", "c", "go"}
    return value


def test_the_bitmask_bans_every_token_whose_bit_is_zero_in_the_rows_it_names():
    gen = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word is partly past the vocabulary
    logits = torch.randn(6, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, 4), generator=gen, dtype=torch.int32)
    rows = [0, 2, 5]
    got = logits.clone()
    apply_token_bitmask(got, GrammarMask(bitmask, rows), bitmask)
    for i in range(6):
        for t in range(vocab):
            allowed = i not in rows or (int(bitmask[i, t // 32]) >> (t % 32)) & 1
            assert got[i, t] == (logits[i, t] if allowed else float("-inf"))


def _seq(seq_id: int, spec: StructuredOutput | None, output: list[int]) -> SeqState:
    params = SamplingParams(structured_output=spec)
    return SeqState(seq_id, f"s{seq_id}", seq_id, [1, *output], 1, params)


def test_a_steps_mask_has_a_row_per_sampled_sequence(tok):
    grammars = Grammars(DEMO_MODEL_PATH, 4096, sorted(tok.eos_token_ids))
    seven = _seq(7, StructuredOutput("regex", "ab"), [])
    eight = _seq(8, StructuredOutput("regex", "ab"), tok.encode("a", add_special_tokens=False))
    grammars.add(seven)
    grammars.add(eight)
    assert seven.grammar is not None and eight.grammar is not None  # kept on the sequence
    mask = grammars.fill([None, seven, _seq(3, None, []), eight])
    assert mask.rows == [1, 3] and mask.bitmask.shape == (4, 128)
    assert bool((mask.bitmask[[0, 2]] == -1).all())  # rows without a grammar allow all
    logits = torch.zeros(4, 4096)
    apply_token_bitmask(logits, mask, mask.bitmask)
    allowed = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    assert allowed[1] == [t for t in range(4096) if tok.decode([t]) in ("a", "ab")]
    assert allowed[3] == [t for t in range(4096) if tok.decode([t]) == "b"]
    assert grammars.accept(eight, allowed[3][0]) and not grammars.accept(seven, allowed[3][0])


def test_the_vocabulary_is_the_tokenizers_and_special_tokens_are_never_text(tok):
    info = tokenizer_info(tok, 4096 + 60, sorted(tok.eos_token_ids))
    assert info.vocab_size == 4096 + 60
    decoded = info.decoded_vocab
    for token_id in (3, 300, 1000, 4000):
        assert decoded[token_id] == tok.decode([token_id]).encode()
    specials = set(info.special_token_ids)
    assert {0, 1} <= specials and set(range(4096, 4156)) <= specials  # EOS (2) stops
    assert list(info.stop_token_ids) == sorted(tok.eos_token_ids)


@pytest.mark.parametrize(
    "spec, words",
    [
        (StructuredOutput("json", '{"type": "bogus"}'), 'Unsupported type "bogus"'),
        (StructuredOutput("regex", "a("), "parenthesis is not closed"),
        (StructuredOutput("ebnf", 'root ::= "a" x'), 'Rule "x" is not defined'),
    ],
)
def test_the_checker_names_what_does_not_compile(tok, spec, words):
    checker = GrammarChecker(tok, 4096)
    for _ in range(2):  # the second answer comes from the cache of verdicts
        with pytest.raises(GrammarError, match=re.escape(words)) as info:
            checker.check(spec)
        assert "/project/" not in str(info.value)  # no source location of xgrammar's
    checker.check(JSON)


def test_constrained_rows_follow_their_grammar_beside_free_ones(tok):
    driver = PlanDriver(runner())
    prompt = tok.encode("A record of the release:")
    driver.add("json", prompt, params(JSON))
    driver.add("regex", prompt, params(REGEX))
    driver.add("free", prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    driver.add("sampled", prompt, params(JSON, temperature=1.0, seed=3))
    out = driver.run(chunk=5)
    check_json(tok, out["json"])
    check_json(tok, out["sampled"])
    assert re.fullmatch(r"(yes|no), because [a-z ]{3,20}\.", tok.decode(out["regex"]))
    assert driver.done["json"].finish_reason == "eos"
    free = PlanDriver(runner())
    free.add("free", prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert free.run()["free"] == out["free"]  # a neighbour's grammar masks only its own row


def test_a_choice_grammar_picks_one_of_its_strings(tok):
    driver = PlanDriver(runner())
    driver.add(
        "c", tok.encode("The answer is"), params(StructuredOutput("ebnf", 'root ::= "up" | "down"'))
    )
    assert tok.decode(driver.run()["c"]) in ("up", "down")


def resend(seq, token_ids: list[int], slot: int) -> NewSequence:
    """The NewSequence a scheduler sends after a preemption: prompt and output so far."""
    return NewSequence(seq.slot, seq.request_id, slot, list(token_ids), seq.num_prompt, seq.params)


def run_with_preemption(r: ModelRunner, tok, fresh_runner: ModelRunner | None = None) -> list[int]:
    """Decodes a few steps, drops the sequence (its slot released, or the whole
    worker replaced), then sends it again with its tokens and decodes to the end."""
    driver = PlanDriver(r)
    seq = driver.add("p", tok.encode("A record of the release:"), params(JSON))
    for _ in range(6):
        driver.step()
    tokens = list(seq.tokens)
    assert len(seq.output) == 6 and not seq.finish_reason  # the prefill sampled one
    if fresh_runner is None:  # preempted: the slot is released, the sequence re-sent
        r.execute(StepPlan(step=driver.step_no, released_slots=[seq.slot]))
        driver.step_no += 1
    else:  # the worker group restarted: a new runner, which never saw the sequence
        r = driver.runner = fresh_runner
    driver._new = [resend(seq, tokens, seq.slot)]
    seq.computed, seq.blocks = 0, []  # recomputed from the first token
    return driver.run(chunk=7)["p"]


def test_a_matcher_is_rebuilt_from_the_tokens_after_preemption_and_restart(tok):
    whole = PlanDriver(runner())
    whole.add("p", tok.encode("A record of the release:"), params(JSON))
    expected = whole.run()["p"]
    check_json(tok, expected)
    assert run_with_preemption(runner(), tok) == expected
    assert run_with_preemption(runner(), tok, fresh_runner=runner()) == expected


def test_a_rank_fills_the_next_mask_from_its_own_token_when_scheduled_ahead(tok):
    """Lookahead plans name no token: the rank feeds its own sampled token to the
    next step and advances the matcher with it."""
    r = runner()
    prompt = tok.encode("A record of the release:")
    p = params(JSON)
    n = len(prompt)
    r.execute(StepPlan(0, [NewSequence(0, "a", 0, prompt, n, p)],
                       [ScheduledSeq(0, 0, n, list(range(-(-n // 4) + 20)), True)]))  # fmt: skip
    output, step = [], 1
    while True:
        result = r.execute(
            StepPlan(step, scheduled=[ScheduledSeq(0, n + len(output), 1, [], True)], ahead=True)
        )
        output += [t.token_id for t in result.sampled]
        step += 1
        if result.finished or len(output) > 60:
            break
    whole = PlanDriver(runner())
    whole.add("a", prompt, p)
    first = whole.step().sampled[0].token_id
    assert [first, *output] == whole.run()["a"]


def test_a_grammar_that_refuses_every_token_ends_only_its_sequence(tok):
    """allowed_token_ids that the grammar never allows: the row is all -inf, the
    token drawn is one the matcher refuses, and the sequence ends with an error."""
    driver = PlanDriver(runner())
    prompt = tok.encode("Hi")
    bad = params(JSON, allowed_token_ids=(tok.encode("x", add_special_tokens=False)[0],))
    driver.add("bad", prompt, bad)
    driver.add("ok", prompt, params(JSON))
    out = driver.run()
    assert driver.done["bad"].finish_reason == "error" and len(out["bad"]) == 1
    check_json(tok, out["ok"])


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "array", "contains": {"const": 5}}, "contains"),
        ({"not": {"type": "string"}}, "not"),
        ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 7}}, "if"),
        ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "allOf with more than one"),
        ({"type": "string", "format": "color"}, "format 'color'"),
        ({"type": "string", "pattern": "[a-z]+", "maxLength": 3}, "a pattern or format"),
        (
            {"type": "object", "properties": {"a": {"type": "object", "dependentRequired": {}}}},
            "dependentRequired",
        ),
        ({"$defs": {"x": {"uniqueItems": True}}, "$ref": "#/$defs/x"}, "uniqueItems"),
    ],
)
def test_schema_keywords_xgrammar_would_not_enforce_are_refused(tok, schema, words):
    with pytest.raises(GrammarError, match=re.escape(words)):
        GrammarChecker(tok, 4096).check(StructuredOutput("json", json.dumps(schema)))


def test_names_of_properties_are_not_mistaken_for_keywords(tok):
    schema = {
        "type": "object",
        "properties": {"not": {"type": "integer", "format": "int32"}, "if": {"enum": ["a"]}},
        "required": ["not"],
        "allOf": [{"required": ["if"]}],  # one schema: xgrammar takes it whole
    }
    checker = GrammarChecker(tok, 4096)
    assert checker.check(StructuredOutput("json", json.dumps(schema))) is None  # accepted
    # The same words as the schema's own keywords are refused.
    keyword = {"type": "object", "properties": schema["properties"], "not": {"required": ["if"]}}
    with pytest.raises(GrammarError, match="not"):
        checker.check(StructuredOutput("json", json.dumps(keyword)))


def test_a_grammar_ends_its_sequence_even_where_ignore_eos_would_go_on(tok):
    """The engine's own callers (LLM, AsyncEngine) can send what the ingress refuses."""
    driver = PlanDriver(runner())
    choice = StructuredOutput("ebnf", 'root ::= "up" | "down"')
    prompt = tok.encode("The answer is")
    driver.add("ignore", prompt, params(choice, ignore_eos=True))
    driver.add("min", prompt, params(choice, min_tokens=5))
    for name, out in driver.run().items():
        assert tok.decode(out[:-1]) in ("up", "down") and out[-1] in tok.eos_token_ids
        assert driver.done[name].finish_reason == "eos"


def test_a_grammar_that_starts_after_a_token_waits_for_it(tok):
    """``start_after`` (a reasoning block's end): nothing before the token is masked,
    the grammar applies from the next one; a sequence re-sent after it replays
    only the tokens after it."""
    grammars = Grammars(DEMO_MODEL_PATH, 4096, sorted(tok.eos_token_ids))
    end = tok.encode(".", add_special_tokens=False)[0]
    waiting = _seq(1, StructuredOutput("regex", "ab", start_after=end), [])
    grammars.add(waiting)
    assert grammars.fill([waiting]) is None  # free while it waits
    x = tok.encode("x", add_special_tokens=False)[0]
    assert grammars.accept(waiting, x) and grammars.accept(waiting, end)
    mask = grammars.fill([waiting])
    assert mask is not None and mask.rows == [0]
    a = tok.encode("a", add_special_tokens=False)
    resent = _seq(2, StructuredOutput("regex", "ab", start_after=end), [x, end, *a])
    grammars.add(resent)  # the matcher replays "a" only
    b = tok.encode("b", add_special_tokens=False)[0]
    assert grammars.accept(resent, b) and grammars.done(resent) is False  # then EOS ends it


def test_a_runner_answers_in_the_grammar_after_its_start_token(tok):
    driver = PlanDriver(runner())
    end = tok.encode(":", add_special_tokens=False)[0]
    # The bias makes the start token the model's first; from the next token the grammar
    # masks it (and every other token it forbids).
    spec = StructuredOutput(REGEX.kind, REGEX.spec, start_after=end)
    driver.add(
        "late", tok.encode("A record of the release"), params(spec, logit_bias=((end, 100.0),))
    )
    output = driver.run()["late"]
    assert output[0] == end
    assert re.fullmatch(r"(yes|no), because [a-z ]{3,20}\.", tok.decode(output[1:]))

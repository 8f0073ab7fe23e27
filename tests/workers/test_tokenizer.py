"""Tokenizer wrapper, sandboxed chat templates and the streaming detokenizer."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from iterserve.workers import IncrementalDetokenizer, Tokenizer
from iterserve.workers.tokenizer import TokenizerError

CORPUS = [
    "hello world, this is a tiny corpus for a tiny tokenizer.",
    "héllo wörld ✓ 日本語のテキスト and some more words",
    "the quick brown fox jumps over the lazy dog 🦊",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer_dir(path, *, template=CHAT_TEMPLATE, extra_config=None, bos_processor=True):
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bos_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": {"content": "<s>", "lstrip": False, "__type": "AddedToken"},
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "chat_template": template,
        **(extra_config or {}),
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = build_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    return Tokenizer(path)


def test_special_tokens_and_eos_ids(tok):
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>"
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.eos_token_ids == {0, 2}


@pytest.mark.parametrize("text", CORPUS + ["", "unseen wørds ✓✓ 日本"])
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text


def test_add_bos_token_flag_overrides_post_processor(tmp_path):
    path = build_tokenizer_dir(tmp_path, bos_processor=False, extra_config={"add_bos_token": True})
    t = Tokenizer(path)
    assert t.encode("hello")[0] == t.bos_token_id
    assert t.bos_token_id not in t.encode("hello", add_special_tokens=False)


def test_chat_template_renders(tok):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi ✓"},
    ]
    text = tok.apply_chat_template(messages)
    assert text == "<s><|system|>be brief</s>\n<|user|>hi ✓</s>\n<|assistant|>"
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith(">")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


def test_chat_template_raise_exception_and_tojson(tmp_path, tok):
    with pytest.raises(TokenizerError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    path = build_tokenizer_dir(tmp_path, template="{{ messages | tojson }}")
    rendered = Tokenizer(path).apply_chat_template([{"role": "user", "content": "<b>ü</b>"}])
    assert json.loads(rendered) == [{"role": "user", "content": "<b>ü</b>"}]
    assert "<b>ü</b>" in rendered


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__ }}",
        "{% set x = messages.append({'role': 'user'}) %}{{ x }}",
        "{{ raise_exception.__globals__ }}",
    ],
)
def test_sandbox_refuses_unsafe_templates(tmp_path, template):
    t = Tokenizer(build_tokenizer_dir(tmp_path, template=template))
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(TokenizerError, match="unsafe|failed"):
        t.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer(tmp_path)


def test_no_chat_template(tmp_path):
    path = build_tokenizer_dir(tmp_path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer(path).apply_chat_template([])
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert Tokenizer(path).apply_chat_template([{"role": "user", "content": "hey"}]) == "hey"


MULTIBYTE = "héllo wörld ✓ 日本 🦊 and ✓✓ ü"


def test_incremental_detokenizer_matches_full_decode(tok):
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    # Byte-level tokens: some characters must span several tokens for this test to bite.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == MULTIBYTE
    assert detok.text == MULTIBYTE
    assert "" in deltas  # some tokens completed no character


def test_incremental_detokenizer_with_prompt_context(tok):
    prompt = tok.encode("hello world,", add_special_tokens=True)
    output = tok.encode(" héllo ✓ 日本語のテキスト " * 12, add_special_tokens=False)
    detok = tok.detokenizer(prompt_ids=prompt)
    streamed = detok.add_many(output) + detok.flush()
    assert streamed == tok.decode(output)
    assert "\ufffd" not in streamed


def test_flush_emits_an_incomplete_tail(tok):
    ids = tok.encode("✓", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert detok.add_many(ids[:-1]) == ""
    assert detok.flush() == tok.decode(ids[:-1])


def test_special_tokens_are_skipped_when_streaming(tok):
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode("hello", add_special_tokens=False) + [tok.eos_token_id]
    assert detok.add_many(ids) + detok.flush() == "hello"

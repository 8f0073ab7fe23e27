"""The bundled demo checkpoint: complete, small, and loadable offline."""

import json

import pytest
import torch

from iterserve.models import DEMO_MODEL_PATH

transformers = pytest.importorskip("transformers")

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
]
MAX_BYTES = 25 * 1000 * 1000


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_PATH, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    model = transformers.AutoModelForCausalLM.from_pretrained(
        DEMO_MODEL_PATH, local_files_only=True
    )
    return model.eval()


def test_checkpoint_files_exist():
    for name in FILES:
        assert (DEMO_MODEL_PATH / name).is_file(), name


def test_checkpoint_is_small():
    total = sum(f.stat().st_size for f in DEMO_MODEL_PATH.iterdir() if f.is_file())
    assert total <= MAX_BYTES


def test_config_is_llama():
    config = json.loads((DEMO_MODEL_PATH / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["torch_dtype"] == "float32"
    assert config["tie_word_embeddings"] is True
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    assert config["hidden_size"] == config["num_attention_heads"] * config["head_dim"]


def test_generation_config_ids_match_tokenizer(tokenizer):
    gen = json.loads((DEMO_MODEL_PATH / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tokenizer.eos_token_id
    assert gen["bos_token_id"] == tokenizer.bos_token_id
    assert gen["max_new_tokens"] > 0


def test_tokenizer_config_declares_special_tokens():
    config = json.loads((DEMO_MODEL_PATH / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    for key in ("bos_token", "eos_token", "pad_token", "model_max_length", "chat_template"):
        assert config[key], key


def test_tokenizer_round_trips_english(tokenizer):
    text = "The list type is a mutable sequence — “naïve” café, 3.14 ≤ π."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) < len(text.encode())
    assert tokenizer.decode(ids) == text
    with_bos = tokenizer(text)["input_ids"]
    assert with_bos[0] == tokenizer.bos_token_id
    assert with_bos[1:] == ids


def test_chat_template_renders(tokenizer):
    messages = [{"role": "user", "content": "What does a decorator do?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith(tokenizer.bos_token)
    assert "What does a decorator do?" in text
    assert text.endswith("<|assistant|>\n")
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert not without.endswith("<|assistant|>\n")


def test_greedy_generation_produces_valid_ids(model, tokenizer):
    enc = tokenizer("A decorator is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **enc,
            do_sample=False,
            max_new_tokens=8,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    new = out[0, enc["input_ids"].shape[1] :]
    assert 1 <= new.numel() <= 8
    assert int(new.min()) >= 0
    assert int(new.max()) < model.config.vocab_size
    assert isinstance(tokenizer.decode(new, skip_special_tokens=True), str)


def test_logits_are_finite(model, tokenizer):
    enc = tokenizer("To open a file", return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape[-1] == model.config.vocab_size
    assert torch.isfinite(logits).all()

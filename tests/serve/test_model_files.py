"""What the served model's files say: --generation-config's sampling defaults (as vLLM
reads them) reaching a request's SamplingParams, and --chat-template's template."""

from __future__ import annotations

import json

import pytest

from iterserve.cluster.openai.jobs import Limits, sampling_params
from iterserve.cluster.openai.protocol import ChatCompletionRequest, CompletionRequest
from iterserve.cluster.serve.model_files import chat_template_text, sampling_defaults


@pytest.fixture
def checkpoint(tmp_path):
    config = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 50,
              "max_new_tokens": 7, "eos_token_id": 2, "repetition_penalty": 1.0}  # fmt: skip
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_auto_takes_the_checkpoints_sampling_keys_that_differ_from_hugging_faces(checkpoint):
    # top_k 50 and repetition_penalty 1.0 are Hugging Face's defaults: vLLM drops them.
    defaults = sampling_defaults("auto", str(checkpoint))
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 7}
    assert sampling_defaults("vllm", str(checkpoint)) == {}
    overridden = sampling_defaults("auto", str(checkpoint), {"temperature": 0.2, "min_p": 0.1})
    assert overridden == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 7, "min_p": 0.1}
    assert sampling_defaults("auto", str(checkpoint / "nowhere")) == {}  # no file: none


def test_bad_defaults_are_refused_once_at_start(checkpoint):
    with pytest.raises(ValueError, match="override_generation_config: unknown key 'seed'"):
        sampling_defaults("auto", str(checkpoint), {"seed": 1})
    with pytest.raises(ValueError, match="generation_config: temperature"):
        sampling_defaults("vllm", str(checkpoint), {"temperature": -1})
    with pytest.raises(ValueError, match="neither auto, vllm nor a directory"):
        sampling_defaults("/no/such/dir", str(checkpoint))


def test_a_request_takes_the_defaults_for_what_it_leaves_unset(checkpoint):
    limits = Limits(4, 5, 128, 320, sampling_defaults("auto", str(checkpoint)))
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    )
    params = sampling_params(chat, None, 10, limits, None)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.6, 0.9, 7)
    own = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0,
         "max_tokens": 50}
    )  # fmt: skip
    params = sampling_params(own, 50, 10, limits, None)
    assert (params.temperature, params.max_tokens) == (0.0, 50)  # the request's own win
    # Completions default to 16 tokens (OpenAI's); max_new_tokens caps that too.
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "hi"})
    assert sampling_params(completion, None, 3, limits, None, 16).max_tokens == 7


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert chat_template_text(str(path)) == path.read_text()
    inline = "{{ messages[0]['content'] }}"
    assert chat_template_text(inline) == inline
    with pytest.raises(ValueError, match="chat_template: no file"):
        chat_template_text(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a Jinja template"):
        chat_template_text("{% for m in messages %}")

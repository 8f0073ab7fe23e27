"""Session-wide test setup.

Triton decides at decoration time whether a kernel is compiled or interpreted,
so ``TRITON_INTERPRET`` must be set before any kernel module is imported. On a
machine without CUDA every Triton kernel runs in the interpreter.
"""

import os
import shutil

# The environment a user's shell would give a command, before this session adds
# anything: what tests of the README's commands run them with.
USER_ENV = dict(os.environ)

# The API keys the session's apps are deployed with, as a deployment gives one: in
# an environment variable of the ingress's node (these, set before Ray starts, are
# in every Ray worker's environment).
API_KEYS = {"ITERSERVE_TEST_API_KEY": "test-key-123", "ITERSERVE_TEST_CLIENT_KEY": "client-key"}
os.environ.update(API_KEYS)


def api_key_env(key: str) -> str:
    """The name of the session's environment variable that holds ``key``."""
    return next(name for name, value in API_KEYS.items() if value == key)


import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (start-up costs seconds),
    with the CPUs this machine has. The engines that tests deploy reserve a
    fraction of a CPU per rank (their fixtures say so), so several fit at once."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            # As `iterserve serve` runs them: at nice 0, not Ray's 15, so this
            # process (the tests' clients) does not take the CPU from the server.
            _system_config={"worker_niceness": 0},
            include_dashboard=False,
            logging_level="ERROR",
            log_to_driver=False,
        )
    yield ray
    ray.shutdown()


# -- the HTTP server's fixtures, shared by tests/serve, tests/client, tests/observability and
# tests/reliability (a conftest's fixtures are visible only below its own folder).

from tests.serve.conftest import _free_port, build_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("serve") / "tiny-chat")


@pytest.fixture(scope="session")
def vocab_size(tokenizer_dir) -> int:
    from iterserve.workers.tokenizer import Tokenizer

    return Tokenizer(tokenizer_dir).vocab_size


@pytest.fixture(scope="session")
def tiny_model_dir(tokenizer_dir, vocab_size, tmp_path_factory):
    """A tiny random Llama whose vocabulary is the tokenizer's, EOS = </s>."""
    import torch
    import transformers

    from tests.workers.tiny_checkpoints import BASE

    config = transformers.LlamaConfig(
        **{**BASE, "vocab_size": vocab_size, "head_dim": 16, "eos_token_id": 2, "bos_token_id": 1}
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("serve") / "tiny-llama"
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def serve_url(ray_session) -> str:
    """Serve's HTTP proxy on loopback, shared by every app of the session."""
    from ray import serve

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()

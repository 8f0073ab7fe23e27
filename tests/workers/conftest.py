"""Session-wide tiny checkpoints and their transformers references."""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoints import SPECS, build_hf_model, save


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny matmuls gain nothing from threads, and on a shared CPU intra-op
    # threads spin at barriers while their siblings are descheduled.
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


class HFReference:
    """A transformers model plus memoised greedy generations."""

    def __init__(self, model):
        self.model = model
        self._greedy: dict[tuple[int, ...], list[int]] = {}

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([ids])).logits[0]  # [len(ids), vocab]

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new_tokens: int = 32) -> list[int]:
        key = (*prompt, -max_new_tokens)
        if key not in self._greedy:
            out = self.model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
            )
            self._greedy[key] = out[0, len(prompt) :].tolist()
        return self._greedy[key]


@pytest.fixture(scope="session")
def hf_models():
    return {}


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory, hf_models):
    """``checkpoint_dir(name)`` -> path of the saved tiny checkpoint ``name``."""
    paths = {}

    def get(name: str):
        if name not in paths:
            model = build_hf_model(name)
            hf_models[name] = HFReference(model)
            paths[name] = save(model, tmp_path_factory.mktemp(name))
        return paths[name]

    return get


@pytest.fixture(scope="session")
def hf_reference(checkpoint_dir, hf_models):
    def get(name: str) -> HFReference:
        checkpoint_dir(name)
        return hf_models[name]

    return get


@pytest.fixture(params=sorted(SPECS))
def arch(request):
    return request.param

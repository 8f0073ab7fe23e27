"""Session-wide tiny checkpoints and their transformers references."""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoints import SPECS, HFReference, build_hf_model, save


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny matmuls gain nothing from threads, and on a shared CPU intra-op
    # threads spin at barriers while their siblings are descheduled.
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


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

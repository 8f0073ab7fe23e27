"""Session-wide test setup.

Triton decides at decoration time whether a kernel is compiled or interpreted,
so ``TRITON_INTERPRET`` must be set before any kernel module is imported. On a
machine without CUDA every Triton kernel runs in the interpreter.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (start-up costs seconds)."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="ERROR",
                 log_to_driver=False)
    yield ray
    ray.shutdown()

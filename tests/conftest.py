"""Session-wide test setup.

Triton decides at decoration time whether a kernel is compiled or interpreted,
so ``TRITON_INTERPRET`` must be set before any kernel module is imported. On a
machine without CUDA every Triton kernel runs in the interpreter.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

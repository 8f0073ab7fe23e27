"""Checkpoints that ship with iterserve.

``DEMO_MODEL_PATH`` is the bundled demo model (a small Llama-architecture
checkpoint trained by ``scripts/train_demo_model.py``), served when no
``--model`` is given.
"""

from pathlib import Path

DEMO_MODEL_PATH = Path(__file__).resolve().parent / "demo"

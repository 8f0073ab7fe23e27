"""Local Hugging Face checkpoints: lazy, shard-aware weight access.

Only the local directory is read — never the network. A directory holds
``config.json``, the weights (``model.safetensors`` or shards listed in
``model.safetensors.index.json``) and optionally ``generation_config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .architectures import SUPPORTED_ARCHITECTURES
from .architectures.keys import token_id_list
from .config import CheckpointError, ModelConfig
from .quant import parse as parse_quantization

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "Checkpoint",
    "CheckpointError",
    "ModelConfig",
    "load_checkpoint",
]


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{what}: {path} not found") from None
    except OSError as exc:
        raise CheckpointError(f"{what}: cannot read {path}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{what}: {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{what}: {path} must hold a JSON object")
    return data


class Checkpoint:
    """A checkpoint directory: config, generation config and lazily read tensors.

    Tensors are read on demand (optionally a slice of one), so a tensor-parallel
    rank reads only its shard.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        self.raw_config = _read_json(self.path / "config.json", "config.json")
        self.config = ModelConfig.from_dict(self.raw_config)
        # how its weights are quantized (None: dense), read and checked now (workers/quant)
        self.quantization = parse_quantization(self.raw_config.get("quantization_config"))
        gen_path = self.path / "generation_config.json"
        self.generation_config = (
            _read_json(gen_path, "generation_config.json") if gen_path.exists() else {}
        )
        self._files = self._index_weights()
        self._handles: dict[Path, Any] = {}

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """EOS ids of config.json and generation_config.json together."""
        gen = token_id_list(
            self.generation_config.get("eos_token_id"), "generation_config.json: eos_token_id"
        )
        return frozenset(self.config.eos_token_ids) | frozenset(gen)

    def _index_weights(self) -> dict[str, Path]:
        single = self.path / "model.safetensors"
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = _read_json(index, "model.safetensors.index.json").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(
                    f"model.safetensors.index.json: {index} has no 'weight_map' object"
                )
            files = {name: self.path / str(fname) for name, fname in weight_map.items()}
            for shard in sorted(set(files.values())):
                if not shard.exists():
                    raise CheckpointError(
                        f"weights: shard {shard.name} listed in the index is missing"
                    )
            return files
        if single.exists():
            with safe_open(single, framework="pt") as f:
                return {name: single for name in f.keys()}  # noqa: SIM118
        raise CheckpointError(
            f"weights: neither model.safetensors nor model.safetensors.index.json in {self.path}"
        )

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def names(self) -> list[str]:
        return list(self._files)

    def _handle(self, name: str) -> Any:
        try:
            file = self._files[name]
        except KeyError:
            raise CheckpointError(
                f"weights: tensor {name!r} is missing from the checkpoint"
            ) from None
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(file, framework="pt")
            except Exception as exc:
                raise CheckpointError(f"weights: cannot open {file.name}: {exc}") from None
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """Tensor ``name``, or its ``[start:stop]`` slice along ``dim``."""
        handle = self._handle(name)
        if dim is None:
            return handle.get_tensor(name)
        part = handle.get_slice(name)
        index = [slice(None)] * len(part.get_shape())
        index[dim] = slice(start, stop)
        return part[tuple(index)]

    def close(self) -> None:
        self._handles.clear()


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Opens a local checkpoint directory, validating its config and weight index."""
    return Checkpoint(path)

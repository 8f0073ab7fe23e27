"""An engine whose ranks would each time the model's products differently: the
real model's executors, at the avx512_bf16 level (where the dtype is measured, not
ruled), with each rank's own measurement faked to say what ``ratios[rank]`` says."""

from __future__ import annotations

from dataclasses import dataclass

from iterserve.cluster.ranks.executors import ModelExecutors


def _fake_measurement(ratio: float) -> None:
    from iterserve.workers import dtype

    dtype.measure_products = lambda *args, **kwargs: ratio


@dataclass(frozen=True)
class RankTimings(ModelExecutors):
    """``ratios``: each rank's bf16 ÷ fp32 time of the model's products, as that rank
    would measure it (under 0.85: bf16 is the faster)."""

    ratios: tuple[float, ...] = (0.5, 0.5)

    def model_info(self, config, device, level=None):
        _fake_measurement(self.ratios[0])  # model_info runs on rank 0
        return super().model_info(config, device, "avx512_bf16")

    def kv_capacity(self, config, rank, world_size, device, runtime=None):
        _fake_measurement(self.ratios[rank])
        return super().kv_capacity(config, rank, world_size, device, runtime)

    def build(self, config, rank, world_size, device, all_reduce, runtime=None):
        _fake_measurement(self.ratios[rank])
        runner = super().build(config, rank, world_size, device, all_reduce, runtime)
        assert runner.choices.isa == "avx512_bf16", runner.choices
        return runner

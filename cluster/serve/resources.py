"""What each serving process reserves on a Ray node, derived from what the node has.

Ray's CPU reservations only place processes (Ray enforces nothing), so a process
that needs no cores of its own reserves a token fraction, and the CPUs go to
the model ranks, whose reservation also sets their torch threads
(``OMP_NUM_THREADS``)::

    process                      reserves                    why
    Serve proxy, controller      0 (Serve's own choice)      placed by Serve
    OpenAIIngress replica        0.1 CPU (ServeArgs)         placed next to the proxy
    EngineServer (scheduler)     0.01 CPU                    sits with its ranks (PACK)
    rank on a GPU node           1 CPU + 1 GPU
    rank on a CPU node           (node CPUs - 1) / ranks     one core stays for the
                                                             ingress, the scheduler and
                                                             Serve's proxy

where "ranks" is every rank on the node: ``tensor_parallel_size`` times the
engine replicas. A rank gets whole CPUs when that many are free, else the
fraction (then one torch thread). ``num_cpus_per_worker`` overrides the share.
"""

from __future__ import annotations

import math
import os

from ..config import EngineConfig

SCHEDULER_CPUS = 0.01
INGRESS_CPUS = 0.1
SERVING_CORES = 1  # left to the ingress, the scheduler and Serve's proxy on a CPU node
SCHEDULER_BUNDLE = {"CPU": SCHEDULER_CPUS}


class NotEnoughCPUsError(RuntimeError):
    """The node cannot hold what the engine reserves; the message says what it needs."""


def node_cpus() -> float:
    """CPUs of the largest node: Ray's view when connected, else this machine's."""
    import ray

    if ray.is_initialized():
        sizes = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
        if sizes:
            return max(sizes)
    try:
        return float(len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return float(os.cpu_count() or 1)


def uses_gpu(config: EngineConfig) -> bool:
    import ray

    if config.device.startswith("cuda"):
        return True
    return (
        config.device == "auto"
        and ray.is_initialized()
        and ray.cluster_resources().get("GPU", 0) >= 1
    )


def rank_cpus(config: EngineConfig, *, num_engine_replicas: int = 1) -> float:
    """CPUs one rank reserves (see the module docstring)."""
    if config.num_cpus_per_worker is not None:
        return config.num_cpus_per_worker
    if uses_gpu(config):
        return 1.0
    num_ranks = config.tensor_parallel_size * num_engine_replicas
    share = (node_cpus() - SERVING_CORES) / num_ranks
    if share <= 0:
        raise NotEnoughCPUsError(
            f"this node has {node_cpus():g} CPU(s); serving on CPUs needs at least "
            f"{SERVING_CORES + 1}: {SERVING_CORES} for the HTTP ingress and the scheduler, "
            f"and at least one for the model's {num_ranks} rank(s). Set "
            "num_cpus_per_worker (e.g. 0.5) to share cores anyway."
        )
    return math.floor(share) if share >= 1 else share


def rank_bundle(config: EngineConfig, *, num_engine_replicas: int = 1) -> dict:
    """What one rank reserves: its CPUs, and a GPU unless the device is the CPU."""
    bundle = {"CPU": rank_cpus(config, num_engine_replicas=num_engine_replicas)}
    if uses_gpu(config):
        bundle["GPU"] = 1
    return bundle


def engine_bundles(config: EngineConfig) -> list[dict]:
    """The placement group of one Serve engine replica: the scheduler, then every rank.
    Reserved together (``placement_strategy``), so with ``PACK`` the scheduler lands
    on its ranks' node. ``config.num_cpus_per_worker`` must be resolved already."""
    return [dict(SCHEDULER_BUNDLE)] + [rank_bundle(config)] * config.tensor_parallel_size


def resolve(config: EngineConfig, *, num_engine_replicas: int = 1) -> EngineConfig:
    """``config`` with the ranks' CPU share fixed, so every process agrees on it."""
    share = rank_cpus(config, num_engine_replicas=num_engine_replicas)
    return config.replace(num_cpus_per_worker=share)


def check_fits(config: EngineConfig, *, num_engine_replicas: int, ingress_cpus: float) -> None:
    """Refuses, before anything starts, a single-node deployment that could never be
    placed (Serve would otherwise wait for resources forever, quietly)."""
    per_engine = SCHEDULER_CPUS + config.tensor_parallel_size * rank_cpus(config)
    needed = ingress_cpus + num_engine_replicas * per_engine
    have = node_cpus()
    if needed > have + 1e-9:
        raise NotEnoughCPUsError(
            f"this node has {have:g} CPU(s) but the deployment reserves {needed:g}: the "
            f"ingress {ingress_cpus:g}, and per engine replica the scheduler "
            f"{SCHEDULER_CPUS:g} plus {config.tensor_parallel_size} rank(s) of "
            f"{rank_cpus(config):g}. Lower num_cpus_per_worker or the engine replicas."
        )

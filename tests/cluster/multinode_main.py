"""Run as a script: a two-node Ray cluster on this machine, the bundled demo model
split over two tensor-parallel ranks, one on each node, so every step's plan and
every all-reduce crosses nodes. Prints a JSON line with where the ranks ran, the
transport the engine chose and what it generated."""

from __future__ import annotations

import asyncio
import json
import sys

import ray
from ray.cluster_utils import Cluster

from iterserve.cluster.config import EngineConfig
from iterserve.cluster.engine.api import AsyncEngine
from iterserve.scheduler import SamplingParams


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    tokens = []
    async for out in engine.generate(prompt, params):
        tokens.extend(out.token_ids)
    return tokens


async def main(prompts: list[list[int]], max_tokens: int) -> dict:
    config = EngineConfig.from_dict(
        dict(
            dtype="float32",
            tensor_parallel_size=2,
            placement_strategy="STRICT_SPREAD",
            num_kv_blocks=64,
            block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_model_len=64,
            num_cpus_per_worker=1.0,
            torch_threads=1,
            step_timeout_s=30,
            max_restarts=0,
        )
    )
    engine = await AsyncEngine(config).start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = await asyncio.gather(*(collect(engine, p, params) for p in prompts))
        nodes = [w["NodeID"] for w in await engine.actor.worker_nodes.remote()]
        links = (await engine.stats())["rank_links"]
    finally:
        await engine.shutdown()
    return {"outputs": outputs, "worker_nodes": nodes, "rank_links": links}


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        result = asyncio.run(main(request["prompts"], request["max_tokens"]))
        result["num_nodes"] = len([n for n in ray.nodes() if n["Alive"]])
        print("RESULT " + json.dumps(result))
    finally:
        ray.shutdown()
        cluster.shutdown()

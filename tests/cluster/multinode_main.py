"""Run as a script: a two-node Ray cluster on this machine, two worker ranks spread
across both nodes (one each), the compiled-graph broadcast crossing nodes. Prints a
JSON line with where the workers ran and what they generated."""

from __future__ import annotations

import asyncio
import json

import ray
from ray.cluster_utils import Cluster

from iterserve.cluster.config import EngineConfig
from iterserve.cluster.engine import AsyncEngine
from iterserve.scheduler import SamplingParams


async def main() -> dict:
    config = EngineConfig(
        executor="fake", executor_options={"output_len": 5, "max_model_len": 64},
        tensor_parallel_size=2, placement_strategy="STRICT_SPREAD", num_kv_blocks=64,
        block_size=4, max_num_seqs=4, max_num_batched_tokens=64, num_cpus_per_worker=1.0,
        step_timeout_s=30,
    )
    engine = await AsyncEngine(config).start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8)
        outputs = {}
        for request_id, prompt in (("a", [1, 2, 3]), ("b", [9, 8, 7, 6, 5])):
            tokens = []
            async for out in engine.generate(prompt, params, request_id=request_id):
                tokens.extend(out.token_ids)
            outputs[request_id] = tokens
        nodes = [w["NodeID"] for w in await engine.actor.worker_nodes.remote()]
    finally:
        await engine.shutdown()
    return {"outputs": outputs, "worker_nodes": nodes}


if __name__ == "__main__":
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        result = asyncio.run(main())
        result["num_nodes"] = len([n for n in ray.nodes() if n["Alive"]])
        print("RESULT " + json.dumps(result))
    finally:
        ray.shutdown()
        cluster.shutdown()

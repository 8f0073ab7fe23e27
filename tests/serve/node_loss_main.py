"""Run as a script: a two-node Ray cluster on this machine (one CPU each: the
machine's two), two engine replicas of the fake model that cannot share a node
(each rank reserves 0.6 CPU), prefix routing. The second node is removed: a load
right after it must all succeed on the replica left; Serve's replacement waits
for room (a node the cluster adds), and once a node joins it serves. Prints a
JSON line of what happened."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import ray
from ray import serve
from ray.cluster_utils import Cluster

APP = "nodes"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replica_nodes() -> dict[str, str]:
    engines = serve.get_deployment_handle("EngineServer", APP)
    placed = engines.broadcast("placement").results(timeout_s=120)
    return {p["workers"][0]["NodeID"]: p for p in placed}


async def _load(url: str, n: int) -> list[int]:
    body = {"model": "demo", "prompt": "one shared system prompt, then a question", "max_tokens": 8}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/completions", json=body) for _ in range(n))
        )
    return [r.status_code for r in responses]


def _serving(url: str) -> int:
    stats = httpx.get(f"{url}/v1/stats", timeout=30).json()
    return sum(1 for r in stats["replicas"] if r.get("ready") and r.get("state") == "serving")


def _add_node(cluster: Cluster):
    """A node of one CPU (a loaded machine may need a second try to start one)."""
    for attempt in range(3):
        try:
            return cluster.add_node(num_cpus=1)
        except Exception:
            if attempt == 2:
                raise
            time.sleep(5)
    raise AssertionError("unreachable")


def _running(deployment: str) -> int:
    app = serve.status().applications.get(APP)
    if app is None or deployment not in app.deployments:
        return 0
    return int(app.deployments[deployment].replica_states.get("RUNNING", 0))


def main() -> dict:
    from iterserve.cluster.serve.app import build_application
    from iterserve.models import DEMO_MODEL_PATH
    from iterserve.scheduler import FakeModel
    from iterserve.workers.tokenizer import Tokenizer

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    result: dict = {}
    try:
        serve.start(proxy_location="Disabled")
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        args = {
            "model": str(DEMO_MODEL_PATH),
            "num_engine_replicas": 2,
            "routing": "prefix",
            "http_port": port,
            "config": {"num_cpus_per_worker": 0.6, "num_kv_blocks": 256, "block_size": 4,
                       "max_num_seqs": 8, "max_num_batched_tokens": 256, "max_model_len": 256},
        }  # fmt: skip
        model = FakeModel(vocab_size=Tokenizer(DEMO_MODEL_PATH).vocab_size, max_model_len=256,
                          step_sleep_s=0.005)  # fmt: skip
        # The head takes the ingress and one replica; the other waits for room until
        # the second node joins (the ingress stands for the load balancer a real
        # cluster has in front: it must not be on the node that is lost).
        deploying = threading.Thread(
            target=serve.run,
            args=(build_application(args, model),),
            kwargs={"name": APP, "route_prefix": "/"},
        )
        deploying.start()
        while _running("EngineServer") < 1 or _running("OpenAIIngress") < 1:
            time.sleep(0.5)
        second = _add_node(cluster)
        deploying.join()
        serve.get_deployment_handle("EngineServer", APP).broadcast("info").results(timeout_s=300)
        result["nodes_before"] = len(_replica_nodes())
        result["before"] = asyncio.run(_load(url, 30))
        cluster.remove_node(second)
        result["after_loss"] = asyncio.run(_load(url, 30))
        result["serving_after_loss"] = _serving(url)
        _add_node(cluster)  # what the Ray autoscaler does for a pending replica
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and _serving(url) < 2:
            time.sleep(1)
        result["serving_after_new_node"] = _serving(url)
        result["after_new_node"] = asyncio.run(_load(url, 30))
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()))

"""The `ray` cluster backend on a real multi-node Ray cluster on this host (`ray.cluster_utils`):
a head with no CPUs for workers, a node with the prefill resource, a node with the decode
resource, every node on 127.0.0.1. `pdserve serve --cluster ray` places each pool's workers on
its nodes, serves the offline engine's tokens with the KV moving over tcp between nodes and over
shm within one, scales a pool onto the right node, and leaves no actor or process behind; a lost
node is a dead worker whose streams go on on another node."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serving import Server
from test_pools_drain import LONG_STREAM, drain_one_of_two_mid_stream, offline, poll, run_streams
from test_pools_drain import PROMPTS as DRAIN_PROMPTS

from pdserve import LLM, SamplingParams
from pdserve.cluster.base import ClusterError
from pdserve.cluster.ray_backend import RayCluster, RayPlacement, parse_resources
from pdserve.security import DeploymentSecrets

# Without it Ray swaps 127.0.0.1 for the machine's interface address (read when Ray is imported);
# the servers inherit it.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

PROMPTS = [f"Request {i}: " + "the quick brown fox jumps over the lazy dog " * (2 + i) for i in range(4)]


@ray.remote(num_cpus=0, resources={"pdserve_decode": 1})
class Placeholder:
    """Holds one unit of the decode resource on a node, so no worker can take it."""

    def ready(self) -> bool:
        return True


class Nodes:
    def __init__(self) -> None:
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False},
        )
        self.prefill = self.add("pdserve_prefill")
        self.decode = self.add("pdserve_decode")
        ray.init(address=self.cluster.address, namespace="pdserve-tests", logging_level="WARNING")

    def add(self, resource: str, amount: float = 2) -> Any:
        node = self.cluster.add_node(num_cpus=2, resources={resource: amount}, node_ip_address="127.0.0.1")
        self.cluster.wait_for_nodes()
        return node

    def free(self, resource: str) -> float:
        return float(ray.available_resources().get(resource, 0.0))

    def wait_free(self, resource: str, amount: float, timeout: float = 30.0) -> None:
        """Until `amount` of `resource` is free (Ray's view lags an actor's end a little)."""
        deadline = time.monotonic() + timeout
        while self.free(resource) != amount:
            assert time.monotonic() < deadline, ray.available_resources()
            time.sleep(0.2)


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    started = Nodes()
    try:
        yield started
    finally:
        ray.shutdown()
        started.cluster.shutdown()


def ray_server(model: Path, nodes: Nodes, *args: str, transport: str = "tcp") -> Server:
    return Server(
        model,
        "--cluster", "ray", "--ray-address", nodes.cluster.address, "--transport", transport,
        "--ray-prefill-resources", json.dumps({"pdserve_prefill": 1}),
        "--ray-decode-resources", json.dumps({"pdserve_decode": 1}),
        *args,
    )  # fmt: skip


def test_bad_placements_are_refused_clearly() -> None:
    assert parse_resources('{"pdserve_prefill": 1}', "--ray-prefill-resources") == {"pdserve_prefill": 1.0}
    for text in ("pdserve_prefill", '["a"]', '{"a": "one"}', '{"a": true}'):
        with pytest.raises(ClusterError, match="--ray-prefill-resources"):
            parse_resources(text, "--ray-prefill-resources")
    with pytest.raises(ClusterError, match="pack or spread"):
        RayPlacement(strategy="random")
    with pytest.raises(ClusterError, match="must be >= 0"):
        RayPlacement(resources={"pdserve_decode": -1})
    with pytest.raises(ClusterError, match="Ray's own"):
        RayPlacement(resources={"CPU": 1})
    with pytest.raises(ClusterError, match="whole number"):
        RayPlacement(num_gpus=1.5)


def test_no_ray_cluster_is_a_clear_error_not_a_hang() -> None:
    async def scenario() -> None:
        secrets = DeploymentSecrets.generate().for_workers()
        started = time.monotonic()
        # Nothing listens there: tried again each second (a head may be starting), then said.
        with pytest.raises(ClusterError, match=r"no Ray cluster at '127\.0\.0\.1:9' .* within 3 s"):
            await RayCluster(secrets, "127.0.0.1:9", connect_timeout=3).connect()
        assert time.monotonic() - started < 8
        with pytest.raises(ClusterError, match="host:port"):
            await RayCluster(secrets, "head-node", connect_timeout=20).connect()

    if ray.is_initialized():  # this process already joined the module's cluster
        pytest.skip("run before the cluster fixture")
    asyncio.run(scenario())


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_workers_land_on_their_pools_nodes_and_serve_the_offline_engines_tokens(
    tiny_llama: Path, nodes: Nodes, transport: str
) -> None:
    if transport == "nixl":
        pytest.importorskip("nixl", reason="the nixl extra is not installed")
    offline = LLM(str(tiny_llama), dtype="float32")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, params)]
    server = ray_server(
        tiny_llama, nodes, "--prefill", "1", "--decode", "1", "--prefill-max", "2", transport=transport
    )
    try:
        pools = server.pools()
        (prefill,), (decode,) = pools["prefill"]["workers"], pools["decode"]["workers"]
        assert prefill["node"] == nodes.prefill.node_id and decode["node"] == nodes.decode.node_id
        # Given no GPU by Ray, a worker sees none (Ray would leave it every GPU of its node).
        for worker in (prefill, decode):
            environ = Path(f"/proc/{worker['pid']}/environ").read_bytes().split(b"\0")
            assert b"CUDA_VISIBLE_DEVICES=" in environ
        assert nodes.free("pdserve_prefill") == 1 and nodes.free("pdserve_decode") == 1
        answers = [
            server.client.completions.create(
                model=server.model, prompt=p, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
            for p in PROMPTS
        ]
        assert answers == expected
        # Across nodes over the deployment's transport, never over shm.
        assert server.metric("pdserve_kv_transfer_bytes_count", transport=transport) >= len(PROMPTS)
        assert server.metric("pdserve_kv_transfer_bytes_count", transport="shm") == 0

        # Scaled through the admin API: the new worker's actor lands on the prefill node.
        assert server.scale("prefill", 2).status_code == 200
        workers = server.wait_pool("prefill", up=2, timeout=120)
        assert {w["node"] for w in workers} == {nodes.prefill.node_id}
        assert nodes.free("pdserve_prefill") == 0
        server.wait_kv_free()
    finally:
        assert server.stop() == 0
    # Nothing left behind: every actor's resources are back, and stop() checked the processes.
    nodes.wait_free("pdserve_prefill", 2)
    nodes.wait_free("pdserve_decode", 2)


def test_streams_move_between_ray_actors_when_decode_scales_up_and_a_worker_drains(
    tiny_llama_4k: Path, nodes: Nodes
) -> None:
    # The elastic pools unchanged on Ray: the decode pool grows by an actor, then the first one
    # drains mid-stream (its streams move, then its actor goes). Both decode actors are on the
    # decode node, so the streams move over shm; the prompts come from the prefill node over tcp.
    # The new actor is up before the streams start: they need only outlast the drain's first look
    # (the rebalance onto a worker that starts mid-stream is tested in memory).
    prompts = DRAIN_PROMPTS[:8]
    expected = offline(tiny_llama_4k, prompts, 1000)
    server = ray_server(
        tiny_llama_4k, nodes, "--prefill", "1", "--decode", "1", "--decode-max", "2", "--decode-min", "1",
        "--num-kv-blocks", "4096",
    )  # fmt: skip
    try:
        assert server.scale("decode", 2).status_code == 200
        server.wait_pool("decode", up=2, starting=0, timeout=120)
        drain_one_of_two_mid_stream(server, prompts, 1000, expected)
        assert {w["node"] for w in server.workers("decode")} == {nodes.decode.node_id}
        moves = server.metric("pdserve_request_migrations_total", outcome="ok")
        assert server.metric("pdserve_kv_transfer_bytes_count", transport="shm", kind="stream") == moves
        assert server.metric("pdserve_kv_transfer_bytes_count", transport="tcp", kind="stream") == 0
        assert server.metric("pdserve_kv_transfer_bytes_count", transport="tcp", kind="prompt") == len(
            prompts
        )
        assert server.metric("pdserve_kv_transfer_bytes_count", transport="shm", kind="prompt") == 0
        nodes.wait_free("pdserve_decode", 1)  # decode-0's actor is gone
    finally:
        assert server.stop() == 0


def test_a_lost_decode_node_is_a_dead_worker_whose_streams_go_on_on_another_node(
    tiny_llama_4k: Path, nodes: Nodes
) -> None:
    # Two decode workers spread over two nodes that offer the decode resource: the module's and
    # one of this test's own (so the module's nodes stay for any test after this one). That node
    # is lost mid-stream: its worker is a dead worker, and its streams go on on the other node
    # (prefilled again from what their clients have seen), every one whole. Streams as long as
    # the context allows: they must outlast the node's removal however fast they decode.
    max_tokens = LONG_STREAM
    prompts = DRAIN_PROMPTS[:4]
    expected = offline(tiny_llama_4k, prompts, max_tokens)
    doomed = nodes.add("pdserve_decode", amount=1)
    # Ray's SPREAD is best effort (CI saw both workers on one node): while the workers start, a
    # placeholder holds one of the module's decode node's two units, so each node has room for one.
    holder = Placeholder.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(nodes.decode.node_id, soft=False)
    ).remote()
    ray.get(holder.ready.remote(), timeout=60)
    try:
        server = ray_server(
            tiny_llama_4k, nodes, "--prefill", "1", "--decode", "2", "--ready-timeout", "60",
            "--num-kv-blocks", "4096", "--ray-strategy", "spread",
        )  # fmt: skip
    finally:
        ray.kill(holder)  # the lost worker's replacement needs that unit
    try:
        decode_nodes = {w["node"] for w in server.workers("decode")}
        assert decode_nodes == {nodes.decode.node_id, doomed.node_id}
        removed = 0.0

        def doomed_streams() -> int:
            return sum(w["running"] or 0 for w in server.workers("decode") if w["node"] == doomed.node_id)

        async def lose_the_node() -> None:
            nonlocal removed
            # The router spreads the streams by load; its view of a worker's streams comes with
            # the worker's next load report.
            await poll(lambda: doomed_streams() > 0, 10, "streams on the doomed node's worker")
            await asyncio.to_thread(nodes.cluster.remove_node, doomed)
            removed = time.monotonic()

        got = run_streams(server, prompts, max_tokens, lose_the_node)
        assert got == expected  # every stream whole, greedy-identical to the offline engine
        assert server.metric("pdserve_request_retries_total", reason="decode_worker_down") >= 1
        assert server.metric("pdserve_requests_total", outcome="ok") == len(prompts)
        # The lost worker is out, and its replacement started on the node that has room.
        workers = server.wait_pool("decode", up=2, timeout=120)
        assert {w["node"] for w in workers} == {nodes.decode.node_id}
        assert time.monotonic() - removed < 120
        server.wait_kv_free()
    finally:
        assert server.stop() == 0  # and no segment of the lost worker left on this host
    nodes.wait_free("pdserve_prefill", 2)
    nodes.wait_free("pdserve_decode", 2)

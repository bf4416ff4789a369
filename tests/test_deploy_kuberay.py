"""deploy/kuberay/raycluster.yaml: it parses, its `pdserve serve` command is one the server
accepts, and its worker groups offer the Ray resources that command places each pool by. (No
Kubernetes cluster is reachable from the tests: this is what can be checked without one.)"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest

from pdserve import serve

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "deploy" / "kuberay" / "raycluster.yaml"


def documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def ray_cluster() -> dict[str, Any]:
    (cluster,) = [d for d in documents() if d["kind"] == "RayCluster"]
    return cluster


def router_args() -> list[str]:
    head = ray_cluster()["spec"]["headGroupSpec"]["template"]["spec"]
    (router,) = [c for c in head["containers"] if c["name"] == "pdserve-router"]
    assert router["command"] == ["pdserve"] and router["args"][0] == "serve"
    return list(router["args"][1:])


def offered(group: dict[str, Any]) -> dict[str, float]:
    """A worker group's custom resources: KubeRay's rayStartParams.resources, a quoted JSON string."""
    raw = group["rayStartParams"].get("resources", '"{}"')
    return dict(json.loads(json.loads(raw)))


def resolved(tmp_path: Path) -> dict[str, Any]:
    """The router command's options, as `pdserve serve` resolves them (raises on any bad flag or
    value); the key files it names (a Kubernetes secret's mount) are stood in for by local ones."""
    args = []
    for arg in router_args():
        name, _, value = arg.partition("=")
        if name in ("--api-key-file", "--admin-key-file"):
            stand_in = tmp_path / Path(value).name
            stand_in.write_text(f"{name.strip('-')}-{'x' * 40}\n")
            stand_in.chmod(0o600)
            arg = f"{name}={stand_in}"
        args.append(arg)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return serve.resolve_options(parser.parse_args(args))


def test_the_router_command_is_one_pdserve_serve_accepts(tmp_path: Path) -> None:
    o = resolved(tmp_path)
    assert o["cluster"] == "ray" and o["transport"] != "shm"
    assert o["host"] == "0.0.0.0" and (o["api_key_file"] and o["admin_key_file"])  # exposed: keyed


def test_each_pools_resources_are_offered_by_a_worker_group_and_the_head_runs_no_worker(
    tmp_path: Path,
) -> None:
    o = resolved(tmp_path)
    spec = ray_cluster()["spec"]
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = spec["workerGroupSpecs"]
    for pool in serve.pool_replicas(o):
        wanted = serve.ray_placements(o)[pool].resources
        assert wanted, f"pool {pool} has no resources of its own: it could land anywhere"
        hosts = [g for g in groups if all(offered(g).get(k, 0) >= v for k, v in wanted.items())]
        assert hosts, f"no worker group offers {wanted} for pool {pool}"
        for group in hosts:  # a memory-backed /dev/shm where workers run
            volumes = group["template"]["spec"]["volumes"]
            assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in volumes)


def test_it_runs_the_ray_version_pdserve_pins() -> None:
    pinned = re.search(r'"ray==([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pinned and ray_cluster()["spec"]["rayVersion"] == pinned.group(1)

"""Where workers compute (pdserve.devices), with made-up GPU inventories: the deployment's device,
each pool's GPUs and each worker's, the environment that confines a worker to its GPU, and the
transport that can serve a GPU's cache - every refusal said before anything starts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve import devices
from pdserve.errors import PdserveError


def gpus(count: int) -> Callable[[], int]:
    return lambda: count


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0", (0,)), ("0,1", (0, 1)), ("0-3", (0, 1, 2, 3)), (" 2 , 0-1", (2, 0, 1)), ("7", (7,))],
)
def test_gpu_lists(text: str, expected: tuple[int, ...]) -> None:
    assert devices.parse_gpus(text, "--prefill-gpus") == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("", "GPU indices"), ("a", "GPU indices"), ("1,,2", "GPU indices"), ("-1", "GPU indices"),
     ("3-1", "runs backwards"), ("0,1,0", "twice"), ("0-2,1", "twice")],
)  # fmt: skip
def test_bad_gpu_lists_are_refused_by_name(text: str, fragment: str) -> None:
    with pytest.raises(PdserveError, match=fragment) as failure:
        devices.parse_gpus(text, "--decode-gpus")
    assert "--decode-gpus" in str(failure.value)


def test_the_device_follows_the_gpus_torch_can_use() -> None:
    assert devices.place("auto", {"prefill": None, "decode": None}, None, gpus(0)) == ("cpu", {})
    assert devices.place("auto", {"colocated": None}, None, gpus(2)) == ("cuda", {})
    assert devices.place("cpu", {"colocated": None}, None, gpus(2)) == ("cpu", {})  # asked for
    assert devices.place("cuda", {"prefill": "0", "decode": "0"}, None, gpus(1)) == (
        "cuda",
        {"prefill": (0,), "decode": (0,)},  # both pools on one GPU
    )
    with pytest.raises(PdserveError, match="no CUDA GPU can be used here"):
        devices.place("cuda", {"colocated": None}, None, gpus(0))
    with pytest.raises(PdserveError, match=r"GPUs are given .* but no CUDA GPU"):
        devices.place("auto", {"prefill": "0", "decode": None}, None, gpus(0))
    with pytest.raises(PdserveError, match="pool decode: GPU 2 does not exist here"):
        devices.place("auto", {"prefill": "0,1", "decode": "2"}, None, gpus(2))
    with pytest.raises(PdserveError, match="--device cpu with a pool's GPUs"):
        devices.place("cpu", {"colocated": "0"}, None, gpus(1))
    with pytest.raises(PdserveError, match="--device must be one of auto, cpu, cuda"):
        devices.place("gpu", {"colocated": None}, None, gpus(1))


def test_on_ray_the_gpus_are_rays_to_give() -> None:
    # This host's GPUs (here: none) say nothing of the cluster's nodes.
    assert devices.place(
        "auto", {"prefill": None, "decode": None}, {"prefill": 1, "decode": 0.5}, gpus(0)
    ) == (
        "cuda",
        {},
    )
    assert devices.place("auto", {"colocated": None}, {"colocated": 0}, gpus(4)) == ("cpu", {})
    with pytest.raises(PdserveError, match=r"GPUs \(num_gpus\) or none"):
        devices.place("auto", {"prefill": None, "decode": None}, {"prefill": 1, "decode": 0}, gpus(0))
    with pytest.raises(PdserveError, match="needs a GPU for every worker"):
        devices.place("cuda", {"colocated": None}, {"colocated": 0}, gpus(0))
    with pytest.raises(PdserveError, match="Ray's to give"):
        devices.place("auto", {"colocated": "0"}, {"colocated": 1}, gpus(0))
    with pytest.raises(PdserveError, match="--device cpu, but Ray would give GPUs"):
        devices.place("cpu", {"colocated": None}, {"colocated": 1}, gpus(0))


def test_each_worker_takes_its_pools_gpus_in_turn() -> None:
    assert [devices.worker_gpu((2, 3), f"decode-{n}") for n in range(5)] == [2, 3, 2, 3, 2]
    assert devices.worker_gpu((), "decode-1") is None  # torch's default (or Ray's choice)
    assert devices.worker_gpu((4,), "check") == 4


def test_a_worker_is_confined_to_its_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.visible_devices(None) == {}
    assert devices.visible_devices(1) == {"CUDA_VISIBLE_DEVICES": "1"}
    # The server was itself confined: index 1 of its view is the host's GPU 5.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert devices.visible_devices(1) == {"CUDA_VISIBLE_DEVICES": "5"}


def test_the_transport_can_serve_the_workers_caches() -> None:
    assert devices.transport_for("cpu", None, "auto") == "shm"
    assert devices.transport_for("cuda", None, "auto") == "tcp"  # staged through pinned memory
    assert devices.transport_for("cuda", "nixl", "auto") == "nixl"
    assert devices.transport_for("cpu", "tcp", "shm") == "tcp"
    with pytest.raises(PdserveError, match="--transport shm keeps each KV cache in host shared memory"):
        devices.transport_for("cuda", "shm", "auto")
    with pytest.raises(PdserveError, match="--same-node-kv shm"):
        devices.transport_for("cuda", "tcp", "shm")


def test_a_cpu_host_is_recognised_without_torch() -> None:
    """No NVIDIA device files here (the CI machines): 0 GPUs, and torch was not needed to say so."""
    if Path("/proc/driver/nvidia/gpus").is_dir() or list(Path("/dev").glob("nvidia[0-9]*")):
        pytest.skip("this host has the NVIDIA driver")
    assert devices.cuda_gpu_count() == 0


def test_a_share_of_the_gpus_multiprocessors() -> None:
    assert devices.sm_share_env(None) == {}
    assert devices.sm_share_env(40) == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40"}
    devices.check_sm_share(None, "--decode-sm-share", "cpu")
    devices.check_sm_share(100, "--decode-sm-share", "cuda")
    for share in (0, 101, -5):
        with pytest.raises(PdserveError, match=r"--decode-sm-share must be a percentage in \[1, 100\]"):
            devices.check_sm_share(share, "--decode-sm-share", "cuda")
    with pytest.raises(PdserveError, match="these workers run on the CPU"):
        devices.check_sm_share(50, "--prefill-sm-share", "cpu")

"""A shared host: the router's (and a client's) CPU per request and token, charged as it happens,
takes its share of the host's CPUs from the workers' steps over a sliding window."""

from __future__ import annotations

import asyncio

import pytest

from pdserve import clock
from pdserve.sim.host import MAX_SHARE, HostLoad
from pdserve.sim.profile import HostCpu

HOST = HostCpu(
    cpus=2, router_request_s=0.02, router_token_s=0.001, client_request_s=0.01, client_token_s=0.002
)


def test_the_share_is_the_recent_cpu_over_the_hosts_cpus() -> None:
    async def main() -> list[float]:
        host = HostLoad(HOST, client_on_host=False, window_s=2.0)
        seen = [host.share()]
        host.request()
        host.tokens(100)  # 0.02 + 0.1 CPU-seconds in the last 2 s, over 2 CPUs
        seen.append(host.share())
        await asyncio.sleep(2.5)  # out of the window
        seen.append(host.share())
        return seen

    assert clock.run_virtual(main) == pytest.approx([0.0, 0.12 / 2 / 2, 0.0])


def test_a_client_on_the_host_counts_and_the_share_is_capped() -> None:
    async def main() -> tuple[float, float, float]:
        with_client = HostLoad(HOST, client_on_host=True)
        with_client.request()
        with_client.tokens(10)
        flooded = HostLoad(HostCpu(cpus=1, router_token_s=1.0), client_on_host=False)
        flooded.tokens(100)
        return with_client.share(), flooded.share(), flooded.stretch()

    share, capped, stretch = clock.run_virtual(main)  # type: ignore[misc]
    assert share == pytest.approx((0.03 + 10 * 0.003) / 2.0 / 2)
    assert capped == MAX_SHARE and stretch == pytest.approx(1 / (1 - MAX_SHARE))


def test_the_routers_idle_work_is_always_there() -> None:
    async def main() -> float:
        return HostLoad(HostCpu(cpus=2, router_idle=0.1), client_on_host=False).stretch()

    assert clock.run_virtual(main) == pytest.approx(1 / (1 - 0.05))

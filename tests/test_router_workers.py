"""The router's worker links against a scripted worker (a real ZeroMQ ROUTER socket speaking the
wire protocol): liveness from load reports, and aborts for what was abandoned."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import pytest
import zmq
import zmq.asyncio
from fakes import ScriptedConnector, until

from pdserve import wire
from pdserve.router.channel import ZmqConnector
from pdserve.router.workers import DownCause, WorkerDown, WorkerSet, WorkerState
from pdserve.security import CurveKeypair, curve_server

ROUTER_KEYS, WORKER_KEYS = CurveKeypair.generate(), CurveKeypair.generate()
READY = wire.Ready("w0", "decode", "m", 1024, 320, "shm", "", "tcp://127.0.0.1:1")


def scripted_worker(context: zmq.asyncio.Context) -> zmq.asyncio.Socket:
    """A ROUTER socket that plays a worker: a CURVE server, as a worker's is (with no ZAP handler
    in this context, it takes any client key)."""
    sock = context.socket(zmq.ROUTER)
    curve_server(sock, WORKER_KEYS)
    return sock


def load() -> wire.Load:
    return wire.Load("w0", 0, 0, 0, 0, 100, 0, 0.0)


async def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def recv(sock: zmq.asyncio.Socket, timeout: float = 5.0) -> tuple[bytes, bytes]:
    identity, payload = await asyncio.wait_for(sock.recv_multipart(), timeout)
    return identity, payload


async def recv_message(sock: zmq.asyncio.Socket, timeout: float = 5.0) -> wire.Message:
    """The next message, past any hellos (empty frames; the router may greet more than once)."""
    while True:
        _, payload = await recv(sock, timeout)
        if payload:
            return wire.decode(payload)


def test_a_worker_that_stops_reporting_is_taken_out_and_its_legs_aborted_when_it_returns() -> None:
    async def scenario() -> None:
        context = zmq.asyncio.Context()
        worker = scripted_worker(context)
        port = worker.bind_to_random_port("tcp://127.0.0.1")
        workers = WorkerSet(ZmqConnector(ROUTER_KEYS), stall_timeout=0.6)
        try:
            workers.add_worker("w0", "decode", f"tcp://127.0.0.1:{port}", WORKER_KEYS.public)
            link = workers.link("w0")
            assert link.state is WorkerState.STARTING
            identity, hello = await recv(worker)
            assert hello == b""
            await worker.send_multipart([identity, wire.encode(READY)])
            await wait_until(lambda: link.state is WorkerState.UP)
            leg = link.open_leg("r.0", prompt_tokens=5)
            assert link.send(wire.AddRequest("r.0", [1, 2, 3], wire.WireSamplingParams(max_tokens=4)))
            assert isinstance(await recv_message(worker), wire.AddRequest)

            # Silence (the connection stays up, as with a hung engine thread): out of service.
            event = await asyncio.wait_for(leg.events.get(), 5)
            assert isinstance(event, WorkerDown) and "stalled" in event.reason
            assert link.state is WorkerState.DOWN and link.abandoned == {"r.0"}
            assert link.down_cause is DownCause.STALLED  # not dropped: it may only have been slow

            # It reports again: back in service, and told to drop what the router gave up on.
            await worker.send_multipart([identity, wire.encode(load())])
            abort = await recv_message(worker)
            assert abort == wire.Abort("r.0") and link.state is WorkerState.UP and not link.abandoned
        finally:
            await workers.close()
            worker.close(linger=0)
            context.term()

    asyncio.run(scenario())


def test_a_worker_that_restarts_at_the_same_address_is_greeted_and_used_again() -> None:
    async def scenario() -> None:
        context = zmq.asyncio.Context()
        workers = WorkerSet(ZmqConnector(ROUTER_KEYS))
        first = scripted_worker(context)
        port = first.bind_to_random_port("tcp://127.0.0.1")
        try:
            workers.add_worker("w0", "decode", f"tcp://127.0.0.1:{port}", WORKER_KEYS.public)
            link = workers.link("w0")
            identity, _ = await recv(first)
            await first.send_multipart([identity, wire.encode(READY)])
            await wait_until(lambda: link.state is WorkerState.UP)
            first.close(linger=0)  # the process goes away ...
            await wait_until(lambda: link.state is WorkerState.DOWN)
            second = scripted_worker(context)  # ... and a new one binds the same address
            second.bind(f"tcp://127.0.0.1:{port}")
            try:
                identity, hello = await recv(second, timeout=10)
                assert hello == b""  # greeted again after the reconnect
                await second.send_multipart([identity, wire.encode(READY)])
                await wait_until(lambda: link.state is WorkerState.UP)
            finally:
                second.close(linger=0)
        finally:
            await workers.close()
            context.term()

    asyncio.run(scenario())


def test_a_draining_worker_takes_nothing_new_but_answers_and_a_removed_one_is_stopped() -> None:
    async def scenario() -> None:
        context = zmq.asyncio.Context()
        worker = scripted_worker(context)
        port = worker.bind_to_random_port("tcp://127.0.0.1")
        workers = WorkerSet(ZmqConnector(ROUTER_KEYS))
        states: list[tuple[str, WorkerState]] = []
        workers.on_state = lambda link: states.append((link.worker_id, link.state))
        try:
            workers.add_worker("w0", "decode")  # starting: the backend has not reported yet
            link = workers.link("w0")
            assert workers.up("decode") == [] and link.state is WorkerState.STARTING
            link.connect(f"tcp://127.0.0.1:{port}", WORKER_KEYS.public)
            identity, _ = await recv(worker)
            await worker.send_multipart([identity, wire.encode(READY)])
            await wait_until(lambda: link.state is WorkerState.UP)
            assert [w.worker_id for w in workers.up("decode")] == ["w0"] and workers.up("prefill") == []
            leg = link.open_leg("r.0")

            workers.drain("w0")
            assert link.state is WorkerState.DRAINING and workers.up("decode") == []
            await worker.send_multipart([identity, wire.encode(wire.Tokens("r.0", [7]))])
            assert (await asyncio.wait_for(leg.events.get(), 5)) == wire.Tokens("r.0", [7])
            await worker.send_multipart([identity, wire.encode(READY)])  # a Ready again ...
            await asyncio.sleep(0.1)
            assert link.state is WorkerState.DRAINING  # ... does not put it back in service

            await workers.remove_worker("w0", "drained")
            assert link.state is WorkerState.STOPPED and "w0" not in workers.links
            event = await asyncio.wait_for(leg.events.get(), 5)
            assert isinstance(event, WorkerDown) and event.reason == "drained"
            assert [s for _, s in states] == [
                WorkerState.STARTING,
                WorkerState.UP,
                WorkerState.DRAINING,
                WorkerState.STOPPED,
            ]
        finally:
            await workers.close()
            worker.close(linger=0)
            context.term()

    asyncio.run(scenario())


def test_only_a_load_report_is_recorded_as_one_and_a_request_that_ends_wakes_a_waiter() -> None:
    # A load report's step samples feed the cost model once each: a request that ends on a
    # worker must wake whoever waits on the set (a drain), not count as another report.
    async def scenario() -> None:
        connector = ScriptedConnector()
        workers = WorkerSet(connector)
        reports: list[wire.Load | None] = []
        workers.on_load = lambda link: reports.append(link.load)
        try:
            workers.add_worker("decode-0", "decode", "fake://decode-0", "key")
            await until(lambda: bool(workers.up("decode")), "decode-0 up")
            leg = workers.link("decode-0").open_leg("r.0", prompt_tokens=5)
            woken = asyncio.create_task(workers.wait_for_change(60.0))
            await asyncio.sleep(0)
            leg.close(abort=False)
            await asyncio.wait_for(woken, 5)
            assert reports == []
            connector.workers["decode-0"].report()
            assert len(reports) == 1 and reports[0] is not None and reports[0].worker_id == "decode-0"
        finally:
            await workers.close()

    asyncio.run(scenario())


def test_a_stalled_worker_that_still_answers_greetings_stays_down_until_it_reports() -> None:
    # A hung engine thread: the worker's RPC thread still answers every hello with Ready, but no
    # load report comes. Ready alone must not put it back in service (it would flap in and out
    # every stall timeout, and never be killed and replaced); its next report does.
    async def scenario() -> None:
        connector = ScriptedConnector()
        workers = WorkerSet(connector, stall_timeout=0.3)
        try:
            workers.add_worker("decode-0", "decode", "fake://decode-0", "key")
            await until(lambda: bool(workers.up("decode")), "decode-0 up")
            worker = connector.workers["decode-0"]
            await until(lambda: workers.view("decode-0").down_cause is DownCause.STALLED, "stalled")  # type: ignore[union-attr]
            states: list[WorkerState] = []
            workers.on_state = lambda view: states.append(view.state)
            answered = worker.readies
            await until(lambda: worker.readies >= answered + 2, "greeted twice more, and answered")
            assert WorkerState.UP not in states
            assert workers.view("decode-0").state is WorkerState.DOWN  # type: ignore[union-attr]
            worker.report()
            assert workers.view("decode-0").state is WorkerState.UP  # type: ignore[union-attr]
        finally:
            await workers.close()

    asyncio.run(scenario())


def test_a_prefill_workers_rate_weighs_the_same_time_of_steps_however_often_it_reports() -> None:
    """A worker reports every 0.1 s, or 10 ms after a step its prefix cache stored blocks in: the
    measured rate (the admission's prediction of a queue's wait) must not depend on which."""

    async def scenario() -> list[float]:
        workers = WorkerSet(ScriptedConnector())
        rates = []
        try:
            for i, (reports, steps_each) in enumerate(((10, 10), (100, 1))):  # 1 s of 10-ms steps
                link = workers.link(workers.add_worker(f"prefill-{i}", "prefill").worker_id)
                link._handle(wire.Ready(f"prefill-{i}", "prefill", "m", 8192, 49152, "shm", "", ""))
                slow = wire.StepSample(0.1, 10, 0, 0, 0)  # 100 prompt tokens a second, measured first
                link._handle(wire.Load(f"prefill-{i}", 0, 0, 0, 0, 100, 0, 0.0, steps=[slow]))
                fast = wire.StepSample(0.01, 10, 0, 0, 0)  # then 1000 a second
                for _ in range(reports):
                    link._handle(
                        wire.Load(f"prefill-{i}", 0, 0, 0, 0, 100, 0, 0.0, steps=[fast] * steps_each)
                    )
                assert link.prefill_tokens_per_s is not None
                rates.append(link.prefill_tokens_per_s)
        finally:
            await workers.close()
        return rates

    bundled, one_by_one = asyncio.run(scenario())
    # After 1 s of the new rate, ~0.45 s of memory: most of the way there, by either cadence.
    assert bundled == pytest.approx(one_by_one, rel=1e-9)
    assert 850 < bundled < 950


def test_a_links_view_counts_its_legs_as_they_go_through_a_request() -> None:
    # The view's leg counts are kept as legs change, not counted per view: through prompts that
    # get their first token, moves asked, legs done or closed and a worker that drops, they are
    # what the legs themselves say, and the queued prompts keep their order (oldest first).
    async def scenario() -> list[tuple[int, int, tuple[int, ...]]]:
        rng = random.Random(7)
        workers = WorkerSet(ScriptedConnector())
        seen = []
        try:
            workers.add_worker("decode-0", "decode", "fake://decode-0", "key")
            await until(lambda: bool(workers.up("decode")), "decode-0 up")
            link = workers.link("decode-0")
            opened = []
            for step in range(600):
                action = rng.random()
                legs = list(link.legs.values())
                if action < 0.3 or not legs:
                    opened.append(link.open_leg(f"r{step}", prompt_tokens=rng.choice([0, 0, 7, 300])))
                elif action < 0.5:  # its first token
                    link._handle(wire.Tokens(rng.choice(legs).leg_id, [1]))
                elif action < 0.6:
                    rng.choice(legs).move_reason = "rebalance"
                elif action < 0.7:
                    rng.choice(legs).done = True  # finished there; the router still listens
                elif action < 0.95:
                    rng.choice(opened).close(abort=rng.random() < 0.5)  # some already gone
                elif step % 3 == 0:
                    link._mark_down(DownCause.DROPPED, "dropped")  # every leg hears of it
                    link._handle(
                        wire.Ready("decode-0", "decode", "m", 1024, 320, "shm", "", "tcp://127.0.0.1:1")
                    )
                    link._handle(load())
                view = link.view()
                legs = list(link.legs.values())
                counted = (
                    sum(not leg.done and leg.prompt_tokens == 0 for leg in legs),
                    sum(not leg.done and leg.move_reason is None for leg in legs),
                    tuple(leg.prompt_tokens for leg in legs if leg.prompt_tokens > 0),
                )
                assert (view.decoding, view.staying, view.queued_prompts) == counted, step
                assert view.streams == len(legs)
                seen.append(counted)
        finally:
            await workers.close()
        return seen

    seen = asyncio.run(scenario())
    assert max(len(queued) for _, _, queued in seen) >= 3  # the legs piled up on the way
    assert max(decoding for decoding, _, _ in seen) >= 3

"""Hostile-input fixtures: one gateway per module and HTTP parser, its upstream in a thread.

Hostile tests send many small requests over blocking sockets; starting a gateway for each
would cost more than the requests. So a module starts its gateway once per parser (the
`both_parsers` marker parametrizes `http_parser`), and the upstream it talks to runs on an
event loop in a thread of its own, whatever the test itself blocks on.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.harness import Behavior, GatewayProcess, RecordingUpstream, make_policy, write_policy

T = TypeVar("T")

TIMEOUT_S = 1.0  # GATEWAY_HEADER_TIMEOUT_S and GATEWAY_BODY_TIMEOUT_S of these gateways


class LoopThread:
    """An event loop running in a daemon thread; `run` waits for a coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        """Cancel what still runs there (a server's handlers), then stop the loop."""

        async def cancel_the_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_the_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.stop()


def start_gateway(
    workdir: Path,
    policy: Mapping[str, Any],
    http_parser: str,
    extra_env: Mapping[str, str] | None = None,
) -> GatewayProcess:
    """`python -m gateway serve` on `policy` and the given parser, started and ready."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {
        "AIOHTTP_NO_EXTENSIONS": "1" if http_parser == "python" else "",
        "GATEWAY_HEADER_TIMEOUT_S": str(TIMEOUT_S),
        "GATEWAY_BODY_TIMEOUT_S": str(TIMEOUT_S),
        **(extra_env or {}),
    }
    gateway = GatewayProcess(
        workdir, write_policy(workdir / "policies.yaml", policy), extra_env=env
    )
    asyncio.run(gateway.start())
    return gateway


@pytest.fixture(scope="module")
def recording_upstream(loop_thread: LoopThread) -> Iterator[RecordingUpstream]:
    """A `RecordingUpstream` serving from the loop thread. Its answers are marked
    (`X-From-Tool`) and have no body, so an answer to HEAD is well formed too."""
    upstream = RecordingUpstream()
    upstream.default = Behavior(body=b"", headers={"X-From-Tool": "1"})
    loop_thread.run(upstream.start())
    yield upstream
    loop_thread.run(upstream.close())


@pytest.fixture(scope="module")
def edge_gateway(
    recording_upstream: RecordingUpstream,
    http_parser: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    """A gateway in front of `recording_upstream`: `ok/**` fenced (external issuer), bodies
    up to 1 KiB, one-second head and body timeouts, on the parser `http_parser` names."""
    gateway = start_gateway(
        tmp_path_factory.mktemp(f"edge-{http_parser}"),
        make_policy(recording_upstream.url, [{"match": "ok/**"}], max_body_bytes=1024, timeout_s=5),
        http_parser,
    )
    yield gateway
    gateway.kill9_sync()

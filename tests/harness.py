"""Real test doubles for end-to-end tests: a recording upstream and the gateway as a subprocess.

Nothing here is a mock. `RecordingUpstream` is a real aiohttp server on 127.0.0.1 that records
what it received and can be scripted per path (delay, gate, status, drop the connection, send
half a body). `GatewayProcess` runs `python -m gateway serve` exactly as an operator would,
configured only through `GATEWAY_*` variables (docs/contract.md §11), so `kill -9` is a real crash
and a restart really reopens the SQLite file.

All clocks are `time.monotonic()` of the test process; the upstream lives in that process, so
its receive and completion times compare directly with the clients' invoke and complete times.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.proxy import appkeys
from gateway.store.base import Store

REPO_ROOT = Path(__file__).resolve().parent.parent
PROBLEM_JSON = "application/problem+json"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def wait_for(
    predicate: Callable[[], bool | Awaitable[bool]],
    *,
    timeout: float = 5.0,
    interval: float = 0.01,
    what: str = "",
) -> None:
    """Poll `predicate` (a plain or a coroutine function) until it holds; a bounded loop that
    fails loudly."""
    deadline = time.monotonic() + timeout
    while not await _holds(predicate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what or predicate}")
        await asyncio.sleep(interval)


async def _holds(predicate: Callable[[], bool | Awaitable[bool]]) -> bool:
    result = predicate()
    return bool(await result) if inspect.isawaitable(result) else bool(result)


class FakeClock:
    """A wall clock a test moves by hand, for a store where time is the subject of the test
    (`SqliteStore(..., clock=FakeClock(1_000.0))`): no sleeping, no flakiness."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# --------------------------------------------------------------------------------------------
# Recording upstream
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Recorded:
    """One request as the upstream received it."""

    seq: int
    method: str
    path_qs: str  # raw path with the raw query, percent-encoding unchanged
    headers: CIMultiDictProxy[str]
    body: bytes
    peer: tuple[str, int] | None  # the gateway's socket: same peer = same keep-alive connection
    received_at: float  # monotonic, when the handler started (head received)
    body_read_at: float | None = None  # monotonic, after the whole body was read
    completed_at: float | None = None  # monotonic, as the answer goes out (or is dropped)
    action: str = "answer"

    @property
    def path(self) -> str:
        return self.path_qs.split("?", 1)[0]

    @property
    def fence(self) -> int | None:
        value = self.headers.get("X-Fence-Token")
        return int(value) if value is not None else None

    @property
    def resource(self) -> str | None:
        return self.headers.get("X-Lease-Resource")


@dataclasses.dataclass
class Behavior:
    """What the upstream does with a request.

    action: "answer" (status/body/headers), "close" (read the request, then close the connection
    without answering: FIN), "abort" (same with RST), "partial" (send the status and headers with
    a Content-Length of len(body), write the first `partial_bytes` bytes, then abort).
    `delay` sleeps before acting; `gate`, when given, is awaited before acting (after the delay).
    """

    status: int = 200
    body: bytes = b'{"ok": true}'
    headers: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: {"Content-Type": "application/json"}
    )
    delay: float = 0.0
    gate: asyncio.Event | None = None
    action: str = "answer"
    partial_bytes: int = 1


Script = Behavior | Callable[[Recorded], Behavior]


class RecordingUpstream:
    """A real aiohttp server that records every request and answers as scripted."""

    def __init__(self, *, base_path: str = "/api", tls: ssl.SSLContext | None = None) -> None:
        self.base_path = base_path.rstrip("/")
        self.tls = tls  # serves HTTPS with this context when given
        self.requests: list[Recorded] = []
        self.default: Script = Behavior()
        self._scripts: dict[str, Script] = {}
        self.inflight: dict[str | None, int] = {}
        self.max_inflight: dict[str | None, int] = {}
        self._runner: web.AppRunner | None = None
        self._seq = 0
        self.port: int | None = None

    # -- scripting ---------------------------------------------------------------------------

    def script(self, path: str, behavior: Script) -> None:
        """Script `path` (as the upstream sees it, without query, e.g. "/api/x")."""
        self._scripts[path] = behavior

    def _behavior_for(self, rec: Recorded) -> Behavior:
        script = self._scripts.get(rec.path, self.default)
        return script(rec) if callable(script) else script

    # -- views -------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("upstream not started")
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.port}{self.base_path}"

    def received(self, *, path: str | None = None, method: str | None = None) -> list[Recorded]:
        return [
            r
            for r in list(self.requests)
            if (path is None or r.path == path) and (method is None or r.method == method)
        ]

    async def wait_received(self, count: int, *, timeout: float = 5.0, **filters: Any) -> None:
        await wait_for(
            lambda: len(self.received(**filters)) >= count,
            timeout=timeout,
            what=f"{count} upstream requests matching {filters}",
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> RecordingUpstream:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", r"/{tail:[\s\S]*}", self._handle)
        # access_log=None: the test output stays readable.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.tls)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def __aenter__(self) -> RecordingUpstream:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- the handler -------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        received_at = time.monotonic()
        self._seq += 1
        transport = request.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        rec = Recorded(
            seq=self._seq,
            method=request.method,
            path_qs=request.raw_path,
            headers=CIMultiDictProxy(CIMultiDict(request.headers)),
            body=b"",
            peer=tuple(peer[:2]) if peer else None,
            received_at=received_at,
        )
        self.requests.append(rec)
        rec.body = await request.read()
        rec.body_read_at = time.monotonic()

        key = rec.resource
        self.inflight[key] = self.inflight.get(key, 0) + 1
        self.max_inflight[key] = max(self.max_inflight.get(key, 0), self.inflight[key])
        try:
            behavior = self._behavior_for(rec)
            rec.action = behavior.action
            if behavior.delay:
                await asyncio.sleep(behavior.delay)
            if behavior.gate is not None:
                await behavior.gate.wait()
            return await self._act(request, rec, behavior)
        finally:
            self._finish(rec)

    def _finish(self, rec: Recorded) -> None:
        """The call is over for the tool: stamp it and leave the in-flight count, once.

        Done just before the last bytes go out, never after: the gateway cannot have the whole
        answer (and send its next call) before this moment, so "received after completed"
        checks never fail because this process was slow to note the end.
        """
        if rec.completed_at is None:
            rec.completed_at = time.monotonic()
            self.inflight[rec.resource] -= 1

    async def _act(
        self, request: web.Request, rec: Recorded, behavior: Behavior
    ) -> web.StreamResponse:
        transport = request.transport
        if behavior.action in ("close", "abort"):
            self._finish(rec)
            if transport is not None:
                if behavior.action == "close":
                    transport.close()
                else:
                    transport.abort()
            # Nothing can be written any more; aiohttp discards this response quietly.
            return web.Response(status=204)
        response = web.StreamResponse(status=behavior.status, headers=dict(behavior.headers))
        response.content_length = len(behavior.body)
        if behavior.action == "partial":
            await response.prepare(request)
            await response.write(behavior.body[: behavior.partial_bytes])
            await asyncio.sleep(0.05)  # let the head and the first bytes leave before the RST
            self._finish(rec)
            if transport is not None:
                transport.abort()
            return response
        if behavior.action != "answer":
            raise ValueError(f"unknown upstream action {behavior.action!r}")
        self._finish(rec)
        await response.prepare(request)
        await response.write(behavior.body)
        await response.write_eof()
        return response


# --------------------------------------------------------------------------------------------
# Policies
# --------------------------------------------------------------------------------------------


def make_policy(
    upstream_url: str,
    resources: Iterable[Mapping[str, Any]],
    *,
    name: str = "tool",
    mount: str = "/tool",
    timeout_s: float = 5,
    connect_timeout_s: float = 2,
    max_body_bytes: int = 1_048_576,
    **upstream_extra: Any,
) -> dict[str, Any]:
    """A policy document (docs/contract.md §8) with one upstream and the given resource rules.

    Each rule defaults to `upstream: <name>`, `lease: {issuer: external}`,
    `concurrency: parallel` and a short `queue_timeout_s`.
    """
    rules = []
    for rule in resources:
        full = {
            "upstream": name,
            "concurrency": "parallel",
            "queue_timeout_s": 5,
            "lease": {"issuer": "external"},
        }
        full.update(rule)
        rules.append(full)
    upstream = {
        "name": name,
        "url": upstream_url,
        "mount": mount,
        "timeout_s": timeout_s,
        "connect_timeout_s": connect_timeout_s,
        "max_body_bytes": max_body_bytes,
        **upstream_extra,
    }
    return {"upstreams": [upstream], "resources": rules}


def write_policy(path: Path, policy: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(dict(policy), sort_keys=False))
    return path


# --------------------------------------------------------------------------------------------
# The gateway in process
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class InProcessGateway:
    """The real app (`create_app`) under aiohttp's test server, as the `make_app` fixture
    builds it: on a real SQLite file, with its real sweeper, in front of `upstream`.

    `client` is aiohttp's `TestClient` (relative paths: `gw.client.post("/tool/x")`);
    `url`, `host` and `port` are for raw sockets or another session.
    """

    client: TestClient
    upstream: RecordingUpstream

    @property
    def server(self) -> Any:
        return self.client.server

    @property
    def app(self) -> web.Application:
        return self.client.server.app

    @property
    def store(self) -> Store:
        """The app's store (`app[appkeys.STORE]`), open while the app runs."""
        return self.app[appkeys.STORE]

    @property
    def host(self) -> str:
        return self.client.host

    @property
    def port(self) -> int:
        return self.client.port

    @property
    def url(self) -> str:
        """The gateway's base URL, without a trailing slash."""
        return str(self.server.make_url("")).rstrip("/")

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the app's metrics registry; 0.0 when it was never set."""
        value = self.app[appkeys.METRICS].registry.get_sample_value(name, labels)
        return value or 0.0

    async def send(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any, Any]:
        """(status, headers, JSON body or None when empty) of one request."""
        async with self.client.request(method, path, **kwargs) as resp:
            text = await resp.text()
            return resp.status, resp.headers, json.loads(text) if text else None

    async def acquire(
        self,
        resource: str,
        owner: str = "worker-a",
        ttl_s: float | None = None,
        key: str | None = None,
    ) -> tuple[int, Any, Any]:
        """POST /_gateway/v1/leases/{resource}: (status, headers, lease or problem)."""
        body: dict[str, Any] = {"owner": owner}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        headers = {"Idempotency-Key": key} if key else {}
        async with self.client.post(
            f"/_gateway/v1/leases/{resource}", json=body, headers=headers
        ) as resp:
            return resp.status, resp.headers, await resp.json(content_type=None)

    async def receipt(self, receipt_id: str) -> dict[str, Any]:
        """GET /_gateway/v1/receipts/{id}: the receipt record."""
        async with self.client.get(f"/_gateway/v1/receipts/{receipt_id}") as resp:
            return await resp.json()  # type: ignore[no-any-return]


AppFactory = Callable[..., Awaitable[InProcessGateway]]
"""The `make_app` fixture: `await make_app(policy, clients=..., environ=..., **settings)`."""


# --------------------------------------------------------------------------------------------
# The gateway as a subprocess
# --------------------------------------------------------------------------------------------


class GatewayStartError(RuntimeError):
    """The gateway exited or never became ready; the message carries its stderr."""


class GatewayProcess:
    """`python -m gateway serve` in a subprocess, configured by GATEWAY_* variables only."""

    ready_path = "/_gateway/readyz"  # started once this answers 200

    def __init__(
        self,
        workdir: Path,
        policy_path: Path,
        *,
        sweep_interval_s: float = 0.2,
        extra_env: Mapping[str, str] | None = None,
        ready_timeout: float = 15.0,
        port: int | None = None,
        tls: ssl.SSLContext | None = None,
        wrapper: Sequence[str] = (),
    ) -> None:
        self.workdir = workdir
        self.wrapper = list(wrapper)  # a command the gateway runs under (the bench's callgrind)
        self.policy_path = policy_path
        self.db_path = workdir / "gw.db"
        self.sweep_interval_s = sweep_interval_s
        self.extra_env = dict(extra_env or {})
        self.ready_timeout = ready_timeout
        # A port given here is kept across restarts, so clients keep one address through
        # kill -9 (the gateway binds with SO_REUSEADDR); else each start takes a fresh one.
        self.fixed_port = port
        # A gateway serving HTTPS (GATEWAY_TLS_* in extra_env): the client context that
        # reaches it, for readiness and `url`.
        self.tls = tls
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._stderr_file: Any = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("gateway not started")
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def stderr_path(self) -> Path:
        return self.workdir / f"gateway-{self.starts}.stderr"

    def stderr_text(self, *, all_runs: bool = True) -> str:
        runs = range(1, self.starts + 1) if all_runs else [self.starts]
        parts = []
        for n in runs:
            path = self.workdir / f"gateway-{n}.stderr"
            if path.exists():
                parts.append(f"--- run {n} ---\n" + path.read_text(errors="replace"))
        return "\n".join(parts)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        env.update(
            {
                "GATEWAY_HOST": "127.0.0.1",
                "GATEWAY_PORT": str(self.port),
                "GATEWAY_DATABASE_URL": f"sqlite:///{self.db_path}",
                "GATEWAY_POLICIES": str(self.policy_path),
                "GATEWAY_SWEEP_INTERVAL_S": str(self.sweep_interval_s),
                "PYTHONPATH": os.pathsep.join(
                    [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
                ),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.extra_env)
        return env

    async def start(self) -> GatewayProcess:
        """Start and wait until ready; a port taken between choosing and binding is retried."""
        for attempt in range(3):
            try:
                await self._start_once()
            except GatewayStartError:
                run = self.stderr_text(all_runs=False).lower()
                if attempt == 2 or "address already in use" not in run:
                    raise
            else:
                return self
        raise AssertionError("unreachable")

    async def _start_once(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("gateway already running")
        self.starts += 1
        # A fresh port per start: a restart right after kill -9 never races the old socket.
        self.port = self.fixed_port or free_port()
        self._stderr_file = open(self.stderr_path, "wb")  # noqa: SIM115 - closed in _reap
        self.proc = subprocess.Popen(
            [*self.wrapper, sys.executable, "-m", "gateway", "serve"],
            cwd=self.workdir,
            env=self.env(),
            stdin=subprocess.DEVNULL,
            stdout=self._stderr_file,
            stderr=self._stderr_file,
            start_new_session=True,
        )
        await self._wait_ready()

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        timeout = aiohttp.ClientTimeout(total=1.0)
        connector = aiohttp.TCPConnector(ssl=self.tls or True)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            while True:
                assert self.proc is not None
                code = self.proc.poll()
                if code is not None:
                    self._reap()
                    raise GatewayStartError(
                        f"gateway exited with {code} before ready:\n{self.stderr_text()}"
                    )
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    async with session.get(f"{self.url}{self.ready_path}") as resp:
                        if resp.status == 200:
                            return
                if time.monotonic() > deadline:
                    self.kill9_sync()
                    raise GatewayStartError(
                        f"gateway not ready within {self.ready_timeout}s:\n{self.stderr_text()}"
                    )
                await asyncio.sleep(0.05)

    def _reap(self) -> None:
        if self._stderr_file is not None:
            self._stderr_file.close()
            self._stderr_file = None

    def kill9_sync(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._reap()

    async def kill9(self) -> None:
        """SIGKILL, like a crash of the process, and wait until it is gone."""
        self.kill9_sync()

    async def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(self.proc.wait, timeout)
        self._reap()
        return code

    async def restart(self) -> GatewayProcess:
        """Start again on the same database (after a kill9 or terminate)."""
        if self.proc is not None and self.proc.poll() is None:
            await self.terminate()
        return await self.start()

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()


# --------------------------------------------------------------------------------------------
# Client helpers
# --------------------------------------------------------------------------------------------


GatewayFactory = Callable[..., Awaitable[GatewayProcess]]
"""The `gateway_factory` fixture: `await gateway_factory(policy, extra_env=..., ...)`."""


def fenced_headers(
    resource: str, fence: int | str, *, owner: str | None = None, **extra: str
) -> dict[str, str]:
    headers = {"X-Lease-Resource": resource, "X-Fence-Token": str(fence)}
    if owner is not None:
        headers["X-Lease-Owner"] = owner
    headers.update(extra)
    return headers


@dataclasses.dataclass
class CallResult:
    """A client call with its client-side timing."""

    label: Any
    invoked_at: float
    completed_at: float
    status: int | None  # None: the connection failed
    headers: CIMultiDictProxy[str] | None
    body: bytes
    error: BaseException | None = None

    def json(self) -> Any:
        return json.loads(self.body)


async def call(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    label: Any = None,
    **kwargs: Any,
) -> CallResult:
    """One request, never raising for transport errors (they are recorded on the result)."""
    invoked_at = time.monotonic()
    try:
        async with session.request(method, url, allow_redirects=False, **kwargs) as resp:
            body = await resp.read()
            return CallResult(label, invoked_at, time.monotonic(), resp.status, resp.headers, body)
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return CallResult(label, invoked_at, time.monotonic(), None, None, b"", exc)


def problem(result: CallResult) -> dict[str, Any]:
    """The problem+json body of a gateway error, checking its media type and status field."""
    assert result.headers is not None, f"no answer: {result.error!r}"
    content_type = result.headers.get("Content-Type", "")
    assert content_type.split(";")[0].strip() == PROBLEM_JSON, (
        f"{result.status} with Content-Type {content_type!r}: {result.body[:300]!r}"
    )
    body = result.json()
    assert body.get("status") == result.status, body
    return body


def problem_summary(result: CallResult) -> tuple[int | None, str | None]:
    """(status, code) of an answer; code is None when it is not problem+json."""
    if result.headers is None:
        return (None, f"transport error: {type(result.error).__name__}")
    content_type = result.headers.get("Content-Type", "").split(";")[0].strip()
    if content_type != PROBLEM_JSON:
        return (result.status, None)
    try:
        return (result.status, result.json().get("code"))
    except ValueError:
        return (result.status, "<bad json>")


async def metric_samples(
    session: aiohttp.ClientSession, gateway_url: str, name: str
) -> dict[str, float]:
    """The samples of one labelled metric as {labels text: value}, from one scrape."""
    async with session.get(f"{gateway_url}/_gateway/metrics") as resp:
        text = await resp.text()
    found = re.findall(rf"^{name}\{{(.*)\}} (\S+)$", text, re.MULTILINE)
    return {labels: float(value) for labels, value in found}


async def fetch_receipts(
    session: aiohttp.ClientSession, gateway_url: str, **filters: Any
) -> list[dict[str, Any]]:
    """Every receipt matching the filters, following cursors (bounded)."""
    items: list[dict[str, Any]] = []
    params = {k: str(v) for k, v in filters.items()}
    params.setdefault("limit", "1000")
    for _ in range(100):
        async with session.get(f"{gateway_url}/_gateway/v1/receipts", params=params) as resp:
            text = await resp.text()
            assert resp.status == 200, f"receipts list answered {resp.status}: {text}"
            page = json.loads(text)
        items.extend(page["items"])
        if not page.get("next_cursor"):
            return items
        params["cursor"] = page["next_cursor"]
    raise AssertionError("receipt pagination did not end within 100 pages")


def pick(record: Mapping[str, Any], fields: Iterable[str]) -> dict[str, Any]:
    """The named fields of a record (missing ones as a marker, so the diff shows them)."""
    return {f: record.get(f, "<missing>") for f in fields}


# --------------------------------------------------------------------------------------------
# Raw HTTP/1.1, for requests a well-behaved client library would refuse or normalise
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RawResponse:
    status: int
    headers: CIMultiDict[str]
    body: bytes

    def as_call(self, label: Any = None) -> CallResult:
        now = time.monotonic()
        return CallResult(label, now, now, self.status, CIMultiDictProxy(self.headers), self.body)


async def raw_request(
    host: str, port: int, payload: bytes, *, timeout: float = 5.0
) -> RawResponse | None:
    """Send `payload` verbatim on a new connection and parse one response (None: closed)."""

    async def exchange() -> RawResponse | None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(payload)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return None
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            headers: CIMultiDict[str] = CIMultiDict()
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    headers.add(name.strip(), value.strip())
            body = await _read_body(reader, headers)
            return RawResponse(status, headers, body)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    return await asyncio.wait_for(exchange(), timeout)


async def _read_body(reader: asyncio.StreamReader, headers: CIMultiDict[str]) -> bytes:
    if "chunked" in headers.get("Transfer-Encoding", "").lower():
        body = b""
        for _ in range(100_000):
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                with contextlib.suppress(asyncio.IncompleteReadError):
                    await reader.readuntil(b"\r\n")
                return body
            body += await reader.readexactly(size)
            await reader.readexactly(2)
        raise AssertionError("too many chunks")
    if "Content-Length" in headers:
        try:
            return await reader.readexactly(int(headers["Content-Length"]))
        except asyncio.IncompleteReadError as exc:
            return exc.partial
    return await reader.read()


def build_raw(
    method: str,
    target: str,
    headers: Iterable[tuple[str, str]] = (),
    body: bytes = b"",
    *,
    host: str = "127.0.0.1",
    content_length: bool = True,
) -> bytes:
    """An HTTP/1.1 request as bytes; header values are UTF-8 (non-ASCII allowed on purpose)."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers]
    if content_length and (body or method in ("POST", "PUT", "PATCH")):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8") + body


def chunked(*chunks: bytes) -> bytes:
    out = b""
    for chunk in chunks:
        out += f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    return out + b"0\r\n\r\n"

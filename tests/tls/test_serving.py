"""The gateway serving HTTPS (docs/contract.md §22): `GATEWAY_TLS_CERT` and `GATEWAY_TLS_KEY`
make it serve HTTPS only, `GATEWAY_TLS_CLIENT_CA` makes every client show a certificate that
CA signed, a bad file stops it at start with one line naming the file, and `SIGHUP` reads the
pair again with no open call dropped (a bad new pair is logged and the old one kept). The
gateway is a real subprocess; the certificates are made by the test."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.client import GatewayClient
from gateway.config.settings import Settings
from gateway.server.serve import ConfigError, serving_tls
from tests.harness import (
    REPO_ROOT,
    Behavior,
    CallResult,
    GatewayFactory,
    GatewayProcess,
    RecordingUpstream,
    call,
    fenced_headers,
    free_port,
    make_policy,
    wait_for,
    write_policy,
)
from tests.replicas.conftest import pg_url  # noqa: F401 - the workers' test needs PostgreSQL
from tests.tls.certs import Authority, Issued, client_context, served_serial


def policy(upstream: RecordingUpstream) -> dict[str, Any]:
    return make_policy(
        upstream.url,
        [
            {"match": "ext/*"},
            {"match": "gw/*", "lease": {"issuer": "gateway", "ttl_s": 30, "max_ttl_s": 60}},
        ],
    )


def tls_env(pair: Issued, client_ca: Path | None = None) -> dict[str, str]:
    env = {"GATEWAY_TLS_CERT": str(pair.cert), "GATEWAY_TLS_KEY": str(pair.key)}
    if client_ca is not None:
        env["GATEWAY_TLS_CLIENT_CA"] = str(client_ca)
    return env


def session_for(context: ssl.SSLContext, **connector: Any) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ssl=context, **connector),
        timeout=aiohttp.ClientTimeout(total=20),
    )


class TestServing:
    """HTTPS only, verified by clients against the gateway's CA."""

    async def test_the_client_library_and_plain_clients_over_https(
        self, tmp_path: Path, upstream: RecordingUpstream, gateway_factory: GatewayFactory
    ) -> None:
        ca = Authority(tmp_path / "pki")
        trusting = client_context(ca.cert)
        gw = await gateway_factory(
            policy(upstream), extra_env=tls_env(ca.issue("gateway")), tls=trusting
        )
        assert gw.url == f"https://127.0.0.1:{gw.port}"

        async with session_for(trusting) as session:
            async with (
                GatewayClient(gw.url, session=session) as client,
                client.lease("gw/1", "worker-a") as lease,
            ):
                answer = await lease.post("/tool/deploy", json={"v": 1})
            assert answer.status == 200
            plain = await call(
                session, "POST", f"{gw.url}/tool/deploy", headers=fenced_headers("ext/1", 7)
            )
            assert plain.status == 200, plain.body
        first, second = upstream.received(path="/api/deploy")
        assert (first.fence, first.headers["X-Forwarded-Proto"]) == (lease.fence, "https")
        assert (second.fence, second.headers["X-Forwarded-Proto"]) == (7, "https")

        # HTTPS only: plain HTTP on the port gets no answer
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            cleartext = await call(session, "GET", f"http://127.0.0.1:{gw.port}/_gateway/readyz")
        assert cleartext.status is None and cleartext.error is not None

        # a client that trusts another CA refuses the gateway's certificate
        async with session_for(client_context(Authority(tmp_path / "other").cert)) as session:
            refused = await call(session, "GET", f"{gw.url}/_gateway/readyz")
        assert isinstance(refused.error, aiohttp.ClientConnectorCertificateError), refused.error
        assert "certificate verify failed" in str(refused.error)

    async def test_an_expired_certificate_is_refused_by_clients(
        self, tmp_path: Path, upstream: RecordingUpstream, gateway_factory: GatewayFactory
    ) -> None:
        ca = Authority(tmp_path / "pki")
        expired = ca.issue("gateway", expired=True)
        # Readiness is asked over a context that does not look at dates; a client does.
        lenient = client_context(ca.cert)
        lenient.check_hostname, lenient.verify_mode = False, ssl.CERT_NONE
        gw = await gateway_factory(policy(upstream), extra_env=tls_env(expired), tls=lenient)
        async with session_for(client_context(ca.cert)) as session:
            result = await call(session, "GET", f"{gw.url}/_gateway/readyz")
        assert isinstance(result.error, aiohttp.ClientConnectorCertificateError), result.error
        assert "certificate has expired" in str(result.error)

    async def test_a_handshake_that_never_comes_is_closed_like_a_slow_head(
        self, tmp_path: Path, upstream: RecordingUpstream, gateway_factory: GatewayFactory
    ) -> None:
        ca = Authority(tmp_path / "pki")
        gw = await gateway_factory(
            policy(upstream),
            extra_env={**tls_env(ca.issue("gateway")), "GATEWAY_HEADER_TIMEOUT_S": "1"},
            tls=client_context(ca.cert),
        )
        started = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)  # no ClientHello
        try:
            assert await asyncio.wait_for(reader.read(), 30) == b""
        finally:
            writer.close()
        # GATEWAY_HEADER_TIMEOUT_S, not asyncio's own minute
        assert 0.9 < time.monotonic() - started < 20


def handshake_refused(result: CallResult) -> bool:
    """The gateway refused the client's certificate. With TLS 1.3 a client learns it on its
    first read, after its own side of the handshake is done: any transport error, no
    answer."""
    return result.status is None and isinstance(result.error, aiohttp.ClientError | OSError)


class TestClientCertificates:
    """`GATEWAY_TLS_CLIENT_CA`: no certificate, or one another CA signed, and no call."""

    async def test_only_clients_with_a_certificate_of_the_client_ca_get_in(
        self, tmp_path: Path, upstream: RecordingUpstream, gateway_factory: GatewayFactory
    ) -> None:
        ca, clients = Authority(tmp_path / "pki"), Authority(tmp_path / "clients", "Clients CA")
        agent = clients.issue("agent", client=True, ips=())
        stranger = Authority(tmp_path / "elsewhere", "Other CA").issue("x", client=True, ips=())
        gw = await gateway_factory(
            policy(upstream),
            extra_env=tls_env(ca.issue("gateway"), client_ca=clients.cert),
            tls=client_context(ca.cert, agent),
        )
        url = f"{gw.url}/tool/deploy"
        headers = fenced_headers("ext/1", 1)
        for presented in (None, stranger):
            async with session_for(client_context(ca.cert, presented)) as session:
                result = await call(session, "POST", url, headers=headers)
            assert handshake_refused(result), (presented, result.status, result.body)
        assert upstream.received(path="/api/deploy") == []

        async with session_for(client_context(ca.cert, agent)) as session:
            result = await call(session, "POST", url, headers=headers)
        assert result.status == 200, result.body
        assert len(upstream.received(path="/api/deploy")) == 1


def install(pair: Issued, live: Path) -> Issued:
    """Put `pair` where the gateway reads its certificate and key (`live/gateway.*`)."""
    live.mkdir(exist_ok=True)
    cert, key = live / "gateway.pem", live / "gateway.key"
    shutil.copyfile(pair.cert, cert)
    shutil.copyfile(pair.key, key)
    return Issued(cert, key, pair.serial)


async def load(session: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> list[CallResult]:
    """Calls one after the other, each on a new connection (a new handshake), until `stop`."""
    results = []
    while not stop.is_set() and len(results) < 400:
        results.append(await call(session, "GET", url))
    return results


class TestReload:
    """SIGHUP: new handshakes get the new pair, open connections and calls keep going."""

    async def test_a_reload_under_load_drops_nothing_and_a_bad_pair_is_refused(
        self, tmp_path: Path, upstream: RecordingUpstream, gateway_factory: GatewayFactory
    ) -> None:
        ca = Authority(tmp_path / "pki")
        old, new = ca.issue("old"), ca.issue("new")
        live = install(old, tmp_path / "live")
        trusting = client_context(ca.cert)
        gate = asyncio.Event()
        upstream.script("/api/slow", Behavior(gate=gate))
        gw = await gateway_factory(policy(upstream), extra_env=tls_env(live), tls=trusting)
        assert await served_serial(gw.port, trusting) == old.serial

        stop = asyncio.Event()
        async with (
            session_for(trusting, limit=0) as kept,
            session_for(trusting, force_close=True) as fresh,
        ):
            # calls in flight across the reload, on connections opened before it
            slow = [
                asyncio.create_task(
                    call(kept, "POST", f"{gw.url}/tool/slow", headers=fenced_headers(f"ext/{i}", 1))
                )
                for i in range(4)
            ]
            loaders = [
                asyncio.create_task(load(fresh, f"{gw.url}/tool/fast", stop)) for _ in range(3)
            ]
            await upstream.wait_received(4, path="/api/slow")
            await wait_for(lambda: len(upstream.received(path="/api/fast")) >= 10, what="load")

            install(new, live.cert.parent)
            gw.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
            await wait_for(lambda: "tls_reloaded" in gw.stderr_text(), what="the reload's log")
            assert await served_serial(gw.port, trusting) == new.serial
            before = len(upstream.received(path="/api/fast"))
            await wait_for(
                lambda: len(upstream.received(path="/api/fast")) >= before + 10,
                what="load after the reload",
            )
            gate.set()
            stop.set()
            slow_results = await asyncio.gather(*slow)
            loaded = [result for batch in await asyncio.gather(*loaders) for result in batch]
        assert [r.status for r in slow_results] == [200] * 4, [r.error for r in slow_results]
        assert {r.status for r in loaded} == {200}, {repr(r.error) for r in loaded}

        # a new pair that does not pair: logged, and the one in use kept
        stray = ca.issue("stray")
        shutil.copyfile(stray.key, live.key)
        shutil.copyfile(ca.issue("next").cert, live.cert)
        gw.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
        await wait_for(lambda: "tls_reload_failed" in gw.stderr_text(), what="the failure's log")
        failure = next(
            line for line in gw.stderr_text().splitlines() if "tls_reload_failed" in line
        )
        assert f"GATEWAY_TLS_KEY: {live.key}: this key does not match the certificate" in failure
        assert "still serving the previous certificate" in failure
        assert await served_serial(gw.port, trusting) == new.serial
        async with session_for(trusting) as session:
            assert (await call(session, "GET", f"{gw.url}/tool/fast")).status == 200
        assert gw.returncode is None

    async def test_sighup_reaches_every_worker_even_one_still_starting(
        self,
        tmp_path: Path,
        upstream: RecordingUpstream,
        pg_url: str,  # noqa: F811 - the fixture imported above
    ) -> None:
        ca = Authority(tmp_path / "pki")
        old, new = ca.issue("old"), ca.issue("new")
        live = install(old, tmp_path / "live")
        trusting = client_context(ca.cert)
        gateway = GatewayProcess(
            tmp_path,
            write_policy(tmp_path / "policies.yaml", policy(upstream)),
            extra_env={
                "GATEWAY_DATABASE_URL": pg_url,
                "GATEWAY_WORKERS": "2",
                "GATEWAY_INSTANCE_ID": "w",
                **tls_env(live),
            },
            port=free_port(),
            tls=trusting,
        )
        try:
            starting = asyncio.create_task(gateway.start())
            # the workers are spawned, and still importing: SIGHUP now must not kill them
            await wait_for(lambda: "workers_started" in gateway.stderr_text(), timeout=15)
            gateway.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
            await starting
            await wait_for(
                lambda: gateway.stderr_text().count("tls_reloaded") == 2,
                timeout=15,
                what="both workers' reloads of the signal sent while they started",
            )
            install(new, live.cert.parent)
            gateway.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
            await wait_for(
                lambda: gateway.stderr_text().count("tls_reloaded") == 4,
                timeout=10,
                what="both workers' reloads",
            )
            # the kernel spreads new connections over both workers: every one sees the new
            serials = {await served_serial(gateway.port or 0, trusting) for _ in range(20)}
            assert serials == {new.serial}
            assert "worker_restarted" not in gateway.stderr_text()
            assert await gateway.terminate() == 0
        finally:
            gateway.kill9_sync()


def serve_exit(tmp_path: Path, env: dict[str, str]) -> tuple[int, list[str]]:
    """`serve` with these settings (it is expected to stop at once): its exit status and the
    lines on stderr that give a reason."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "serve"],
        cwd=tmp_path,
        env={**base, "PYTHONPATH": str(REPO_ROOT), "GATEWAY_PORT": "0", **env},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    reasons = [line for line in result.stderr.splitlines() if line.startswith("fence-gateway:")]
    return result.returncode, reasons


class TestBadFiles:
    """A missing, unreadable or mismatched file: exit 2 at start, one line naming it."""

    def test_serve_exits_2_with_one_line_naming_the_file(
        self, tmp_path: Path, upstream: RecordingUpstream
    ) -> None:
        ca = Authority(tmp_path / "pki")
        pair, other = ca.issue("gateway"), ca.issue("other")
        env = {
            "GATEWAY_POLICIES": str(write_policy(tmp_path / "policies.yaml", policy(upstream))),
            "GATEWAY_DATABASE_URL": f"sqlite:///{tmp_path}/gw.db",
            "GATEWAY_TLS_CERT": str(pair.cert),
            "GATEWAY_TLS_KEY": str(other.key),
        }
        assert serve_exit(tmp_path, env) == (
            2,
            [
                f"fence-gateway: GATEWAY_TLS_KEY: {other.key}: this key does not match the "
                f"certificate in {pair.cert}"
            ],
        )
        assert not (tmp_path / "gw.db").exists()  # stopped before anything was opened

    def test_what_each_file_s_problem_says(self, tmp_path: Path) -> None:
        ca = Authority(tmp_path / "pki")
        pair = ca.issue("gateway")
        folder, missing = tmp_path / "a-folder.pem", tmp_path / "missing.pem"
        folder.mkdir()
        cases = [
            (
                {"tls_cert": str(missing), "tls_key": str(pair.key)},
                f"GATEWAY_TLS_CERT: {missing}: cannot be read: No such file or directory",
            ),
            (
                {"tls_cert": str(pair.cert), "tls_key": str(folder)},
                f"GATEWAY_TLS_KEY: {folder}: cannot be read: Is a directory",
            ),
            (
                {"tls_cert": str(pair.key), "tls_key": str(pair.key)},
                f"GATEWAY_TLS_CERT: {pair.key}: holds no PEM certificate (BEGIN CERTIFICATE)",
            ),
            (
                {"tls_cert": str(pair.cert), "tls_key": str(pair.cert)},
                f"GATEWAY_TLS_KEY: {pair.cert}: holds no PEM private key (BEGIN PRIVATE KEY)",
            ),
            (
                {**_settings(pair), "tls_client_ca": str(missing)},
                f"GATEWAY_TLS_CLIENT_CA: {missing}: cannot be read: No such file or directory",
            ),
            (
                {"tls_cert": str(pair.cert)},
                "GATEWAY_TLS_CERT and GATEWAY_TLS_KEY go together: set both to serve HTTPS, "
                "or neither",
            ),
            (
                {"tls_client_ca": str(ca.cert)},
                "GATEWAY_TLS_CLIENT_CA needs GATEWAY_TLS_CERT and GATEWAY_TLS_KEY: client "
                "certificates are asked for in the TLS handshake of an HTTPS gateway",
            ),
        ]
        for values, message in cases:
            with pytest.raises(ConfigError) as caught:
                serving_tls(Settings(**values))
            assert str(caught.value) == message
        # one file holding both, and empty settings meaning unset
        combined = tmp_path / "combined.pem"
        combined.write_bytes(pair.cert.read_bytes() + pair.key.read_bytes())
        assert serving_tls(Settings(tls_cert=str(combined), tls_key=str(combined))) is not None
        assert serving_tls(Settings(tls_cert="", tls_key="")) is None


def _settings(pair: Issued) -> dict[str, str]:
    return {"tls_cert": str(pair.cert), "tls_key": str(pair.key)}

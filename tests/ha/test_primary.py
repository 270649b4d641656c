"""Finding the primary and recording store epochs, on a real Patroni cluster (asynchronous
replication) (docs/contract.md §19): the store as a replica uses it, in process.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import struct
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gateway.core.errors import StoreUnavailable
from gateway.store.base import Admitted, Refused
from gateway.store.postgres import PostgresStore
from tests.ha.cluster import PG_BIN, Cluster
from tests.pg import create_database, drop_database, url_of
from tests.store.test_contract import call, ok

asyncpg = pytest.importorskip("asyncpg")


@pytest.fixture
def database(async_cluster: Cluster) -> Iterator[str]:
    name = f"fg_ha_{secrets.token_hex(4)}"
    async_cluster.create_database(name)
    yield name
    async_cluster.drop_database(name)


def store_on(url: str, instance: str = "ha-1", **options: object) -> PostgresStore:
    options.setdefault("heartbeat_interval_s", 0.5)
    return PostgresStore(url, instance=instance, **options)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def fake_server(answer: bytes | None) -> AsyncIterator[str]:
    """A TCP server on loopback: `None` accepts and never says a word (a hanging host);
    else it refuses SSL, reads the startup message and sends `answer`, then hangs up."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if answer is None:
                await reader.read()  # until the client gives up
                return
            while True:
                length = struct.unpack("!I", await reader.readexactly(4))[0]
                body = await reader.readexactly(length - 4)
                if struct.unpack("!I", body[:4])[0] == 80877103:  # SSLRequest
                    writer.write(b"N")
                    continue
                writer.write(answer)
                await writer.drain()
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.close()


def starting_up() -> bytes:
    """The ErrorResponse a PostgreSQL that is starting up sends (SQLSTATE 57P03)."""
    fields = b"".join(
        [b"SFATAL\0", b"VFATAL\0", b"C57P03\0", b"Mthe database system is starting up\0", b"\0"]
    )
    return b"E" + struct.pack("!I", len(fields) + 4) + fields


def url_with(cluster: Cluster, database: str, *hosts: str) -> str:
    return f"postgresql://postgres@{','.join(hosts)}/{database}"


class TestFindingThePrimary:
    """Only a host that accepts writes is ever used, whatever the URL lists first."""

    async def test_a_standby_a_hanging_host_and_one_starting_up_are_skipped(
        self, async_cluster: Cluster, database: str
    ) -> None:
        primary = async_cluster.wait_primary()
        standby = async_cluster.standbys()[0]
        async with fake_server(None) as hanging, fake_server(starting_up()) as starting:
            url = url_with(async_cluster, database, standby.address, hanging, starting,
                           primary.address)  # fmt: skip
            store = store_on(url, connect_timeout_s=1.0)
            began = time.monotonic()
            await store.open()
            try:
                assert time.monotonic() - began < 10  # one second for the hanging host
                assert isinstance(await store.admit(call(3)), Admitted)
                errors = store._link.finder.last_errors
                assert [str(h) for h in errors] == [standby.address, hanging, starting]
                assert "read-only" in errors[store._link.finder.hosts.hosts[0]]
                assert "TimeoutError" in errors[store._link.finder.hosts.hosts[1]]
                assert "starting up" in errors[store._link.finder.hosts.hosts[2]]
            finally:
                await store.close()

    async def test_at_start_no_writable_host_names_each_hosts_error(
        self, async_cluster: Cluster, database: str
    ) -> None:
        standby = async_cluster.standbys()[0]
        async with fake_server(None) as hanging:
            url = url_with(async_cluster, database, standby.address, hanging)
            store = store_on(url, connect_timeout_s=0.5, start_timeout_s=1.0)
            with pytest.raises(StoreUnavailable) as raised:
                await store.open()
        message = str(raised.value)
        assert f"{standby.address}: NoWritableHost: read-only" in message
        assert f"{hanging}: TimeoutError" in message


class TestEpochs:
    """Each new epoch is recorded once, before anything is admitted in it."""

    async def test_a_switchover_is_followed_and_its_epoch_recorded_once_with_the_floor(
        self, async_cluster: Cluster, database: str
    ) -> None:
        url = async_cluster.url(database)
        stores = [store_on(url, f"ha-{i}") for i in range(2)]
        await asyncio.gather(*(s.open() for s in stores))
        try:
            assert [c for s in stores for c in s.drain_epoch_changes()] == []
            first = await stores[0].latest_epoch_change()  # recorded plainly
            assert first is not None and (first.previous, first.current.floor) == (None, None)
            assert isinstance(await stores[0].admit(call(7, resource="ext/1")), Admitted)
            lease = await stores[1].acquire("gw/1", "w1", 60, 0, None, None)
            assert lease.lease.fence == 1
            async_cluster.switchover()
            # Both replicas come back to the new primary with no restart; what they admit
            # in the new epoch is judged after the floor.
            results = await asyncio.gather(*(until_it_answers(s, i) for i, s in enumerate(stores)))
            assert results[0] == Refused("stale_fence", results[0].receipt_id)  # on hold
            assert results[1].lease.fence == 1_000_007  # the floor: highest (7) + gap
            changes = [c for s in stores for c in s.drain_epoch_changes()]
            assert len(changes) == 1, changes
            [change] = changes
            assert change.previous is not None and change.current.timeline == (
                change.previous.timeline + 1
            )
            assert change.reason == "a new timeline (a promotion)"
            assert change.floor is not None and change.floor.floor == 1_000_007
            assert change.floor.leases_expired == 1
            latest = await stores[0].latest_epoch_change()
            assert latest is not None and latest.current == change.current
        finally:
            await asyncio.gather(*(s.close() for s in stores))
            async_cluster.wait_streaming(1)

    async def test_a_call_admitted_before_the_floor_is_never_sent_after_it(
        self, async_cluster: Cluster, database: str
    ) -> None:
        """§19: after an `async` failover no call under a fence lower than one accepted is
        forwarded. The floor expires the old lease and turns its call `outcome_unknown`, and
        the next owner's call, above the floor, has nothing pending ahead of it and goes at
        once; the old owner's call, admitted in the old epoch and still in its replica's
        hands (waiting its turn, or paused), must not go then, though the replica's
        heartbeat (here every 10 s) lived on through the failover."""
        url = async_cluster.url(database)
        a, b = (store_on(url, name, heartbeat_interval_s=10.0) for name in ("ha-a", "ha-b"))
        await asyncio.gather(a.open(), b.open())
        try:
            old = await a.acquire("gw/1", "w1", 600, 0, None, None)
            before = await a.admit(
                call(old.lease.fence, resource="gw/1", issuer="gateway", owner="w1")
            )
            assert isinstance(before, Admitted) and a.may_forward(before.instance)
            async_cluster.switchover()
            await asyncio.gather(until_beat(a), until_beat(b))
            new = await b.acquire("gw/1", "w2", 600, 0, None, None)
            after = await b.admit(
                call(new.lease.fence, resource="gw/1", issuer="gateway", owner="w2", key="k2")
            )
            assert isinstance(after, Admitted) and not after.ahead
            assert b.may_forward(after.instance)  # the new owner's call goes at once...
            assert not a.may_forward(before.instance)  # ...and the old one's never
        finally:
            await asyncio.gather(a.close(), b.close())
            async_cluster.wait_streaming(1)


class TestRestoredIntoAnotherCluster:
    async def test_a_dump_restored_into_another_cluster_applies_the_floor_at_first_start(
        self, async_cluster: Cluster, database: str, tmp_path: Path
    ) -> None:
        source = create_database()  # the machine's own PostgreSQL: another system identifier
        try:
            before = store_on(url_of(source))
            await before.open()
            try:
                assert isinstance(await before.admit(call(40, resource="ext/1")), Admitted)
                await before.acquire("gw/1", "w1", 60, 0, None, None)
            finally:
                await before.close()
            dump = tmp_path / "store.dump"
            subprocess.run(
                [str(PG_BIN / "pg_dump"), "--format=custom", f"--file={dump}", url_of(source)],
                check=True,
            )
        finally:
            drop_database(source)
        target = async_cluster.url(database)
        # libpq takes the first host that answers unless told to look for the primary
        subprocess.run(
            [
                str(PG_BIN / "pg_restore"),
                "--no-owner",
                f"--dbname={target}?target_session_attrs=read-write",
                str(dump),
            ],
            check=True,
        )
        store = store_on(target)
        await store.open()  # no command run: the first start finds the new epoch
        try:
            [change] = store.drain_epoch_changes()
            assert change.reason == "another cluster (a new system identifier)"
            assert change.floor is not None and change.floor.floor == 1_000_040
            refused = await store.admit(call(41, resource="ext/1", key="k9"))
            assert isinstance(refused, Refused) and refused.code == "stale_fence"  # on hold
            lease = await store.acquire("gw/2", "w2", 60, 0, None, None)
            assert lease.lease.fence == 1_000_040
        finally:
            await store.close()


async def until_it_answers(store: PostgresStore, i: int, timeout: float = 60) -> object:
    """Ask again while the store has no primary: an admission (replica 0) or an acquire."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if i == 0:
                return await store.admit(call(8, resource="ext/1", key="k2"))
            return await store.acquire("gw/1", "w2", 60, 0, None, None)
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


__all__ = ["ok"]


async def until_beat(store: PostgresStore, timeout: float = 60) -> None:
    """A heartbeat that reaches the primary (the first may meet the old one's connections)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await store.heartbeat()
            return
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)

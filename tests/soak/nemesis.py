"""The nemesis: faults done to the gateways of a soak, one at a time, at random moments.

Each fault is an `Action`: it says whether it applies to a cluster, does its harm to one
gateway and undoes it before it returns (restarts what it killed, resumes what it paused), so
the next action always starts from a whole cluster. `ACTIONS` is the list a soak draws from;
another fault (say, restoring an older backup of a SQLite store) is one more class with the
same three members added to it, or to the list a caller passes in. On a Patroni cluster the
primary itself fails over (`FailOverThePrimary`).

The nemesis plays the actions in rounds: every applicable action once per round, in a random
order, each on a random gateway, with a random quiet gap before each. So even a short soak
has each fault at least once. A kill or a pause waits (a second at most) for a moment when the
tool has a call in flight, so that it lands mid-call, where recovery has work to do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tests.harness import GatewayProcess, GatewayStartError
from tests.pg import server_sql


@dataclasses.dataclass
class Cluster:
    """The gateways under test, and what the nemesis needs to know to hurt them."""

    gateways: list[GatewayProcess]
    lease_ttl_s: float  # the gateway-issued leases' TTL: a pause must outlast it
    database: str | None = None  # the PostgreSQL database, None on SQLite
    # The `application_name` of each gateway's database connections (PostgreSQL only).
    connection_names: list[str] = dataclasses.field(default_factory=list)
    # How many calls the tool is running right now: a crash or a pause matters most then.
    calls_in_flight: Callable[[], int] = lambda: 0
    # The Patroni cluster under the store (tests.ha.cluster.Cluster), None without one.
    ha: Any = None

    async def mid_call(self, patience_s: float = 1.0) -> None:
        """Return once the tool has a call in flight, or after `patience_s` anyway."""
        deadline = time.monotonic() + patience_s
        while not self.calls_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)


class Action(Protocol):
    """One kind of fault. `name` is what the soak counts it under ("kills", "pauses", …)."""

    name: str

    def applies(self, cluster: Cluster) -> bool: ...

    async def __call__(self, cluster: Cluster, target: int, rng: random.Random) -> None: ...


class Kill9AndRestart:
    """`kill -9` the gateway, leave it dead a moment, start it again on the same store and
    port (SQLite: recovery at start; PostgreSQL: a new instance id, peers recover the old
    one's calls)."""

    name = "kills"

    def applies(self, cluster: Cluster) -> bool:
        return True

    async def __call__(self, cluster: Cluster, target: int, rng: random.Random) -> None:
        gateway = cluster.gateways[target]
        await cluster.mid_call()
        await gateway.kill9()
        await asyncio.sleep(rng.uniform(0.0, 0.5))
        await restart(gateway)


class PausePastTheLease:
    """SIGSTOP the gateway for longer than a lease's TTL (and, on PostgreSQL, than its
    heartbeat lease), then SIGCONT: leases expire and are taken over, peers give its calls
    up, and it wakes up to find out."""

    name = "pauses"

    def applies(self, cluster: Cluster) -> bool:
        return True

    async def __call__(self, cluster: Cluster, target: int, rng: random.Random) -> None:
        gateway = cluster.gateways[target]
        assert gateway.proc is not None
        await cluster.mid_call()
        gateway.proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(cluster.lease_ttl_s * rng.uniform(1.3, 2.5))
        finally:
            gateway.proc.send_signal(signal.SIGCONT)


class KillDatabaseConnections:
    """`pg_terminate_backend` every database connection of one replica, mid-whatever."""

    name = "connection kills"

    def applies(self, cluster: Cluster) -> bool:
        return cluster.database is not None and cluster.ha is None

    async def __call__(self, cluster: Cluster, target: int, rng: random.Random) -> None:
        await server_sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{cluster.database}' "
            f"AND application_name = '{cluster.connection_names[target]}'"
        )


class FailOverThePrimary:
    """On a Patroni cluster (docs/contract.md §19): a planned switchover, or a kill -9 of the
    primary (its Patroni and every PostgreSQL process) until a standby is promoted, the
    killed node then rejoining as a standby. `target` is not used: every gateway loses its
    primary at once."""

    name = "failovers"

    def __init__(self) -> None:
        self._played = 0

    def applies(self, cluster: Cluster) -> bool:
        return cluster.ha is not None

    async def __call__(self, cluster: Cluster, target: int, rng: random.Random) -> None:
        ha = cluster.ha
        await cluster.mid_call()
        self._played += 1
        # the cluster's helpers block: in a thread, so that the calls go on meanwhile
        if self._played % 2:
            await asyncio.to_thread(ha.switchover)
        else:
            killed = await asyncio.to_thread(ha.kill_primary)
            await asyncio.to_thread(ha.wait_primary, 90.0, killed)
            await asyncio.to_thread(ha.rejoin, killed)
        await asyncio.to_thread(ha.wait_streaming, ha.size - 1)


ACTIONS: tuple[Action, ...] = (
    Kill9AndRestart(),
    PausePastTheLease(),
    KillDatabaseConnections(),
    FailOverThePrimary(),
)


async def restart(gateway: GatewayProcess, attempts: int = 3) -> None:
    """Start a killed gateway again; a start that fails (its port briefly taken, a machine
    too busy to be ready in time) is tried again before the soak gives up."""
    for attempt in range(attempts):
        try:
            await gateway.start()
            return
        except GatewayStartError:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(0.5)


async def run_nemesis(
    cluster: Cluster,
    stop: asyncio.Event,
    rng: random.Random,
    counts: Counter[str],
    *,
    actions: Sequence[Action] = ACTIONS,
    gap_s: tuple[float, float] = (0.3, 1.5),
) -> None:
    """Play `actions` in rounds until `stop` is set; count each one played in `counts`.

    The first round, and one under way when `stop` is set, are played to their end, so every
    action is played at least once however short the soak, and the cluster is whole (nothing
    paused, nothing dead) when this returns."""
    usable = [action for action in actions if action.applies(cluster)]
    for action in usable:
        counts.setdefault(action.name, 0)
    while True:
        order = list(usable)
        rng.shuffle(order)
        for action in order:
            await asyncio.sleep(rng.uniform(*gap_s))
            await action(cluster, rng.randrange(len(cluster.gateways)), rng)
            counts[action.name] += 1
        if stop.is_set():
            return

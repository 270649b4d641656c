"""The nemesis plays its actions in rounds: each applicable one at least once, however soon
it is told to stop, and an action of one's own joins by being in the list."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path

from tests.harness import GatewayProcess
from tests.soak.nemesis import ACTIONS, Cluster, run_nemesis


class Recording:
    """An action that only notes where it was played."""

    def __init__(self, name: str, *, applies: bool = True) -> None:
        self.name, self._applies = name, applies
        self.targets: list[int] = []

    def applies(self, cluster: Cluster) -> bool:
        return self._applies

    async def __call__(self, cluster: Cluster, target: int, rng: random.Random) -> None:
        self.targets.append(target)


def cluster(tmp_path: Path, size: int = 2, database: str | None = None) -> Cluster:
    gateways = [GatewayProcess(tmp_path, tmp_path / "p.yaml") for _ in range(size)]
    return Cluster(gateways, lease_ttl_s=1.0, database=database)


async def test_a_round_is_played_out_even_when_told_to_stop_at_once(tmp_path: Path) -> None:
    restore, kill = Recording("restores"), Recording("kills")
    never = Recording("never", applies=False)
    stop, counts = asyncio.Event(), Counter[str]()
    stop.set()
    await run_nemesis(
        cluster(tmp_path),
        stop,
        random.Random(1),
        counts,
        actions=[restore, kill, never],
        gap_s=(0, 0),
    )
    assert counts == {"restores": 1, "kills": 1}
    assert never.targets == [] and len(restore.targets) == len(kill.targets) == 1


async def test_rounds_go_on_until_stopped_each_on_any_gateway(tmp_path: Path) -> None:
    pause = Recording("pauses")
    stop, counts = asyncio.Event(), Counter[str]()
    nemesis = asyncio.create_task(
        run_nemesis(
            cluster(tmp_path), stop, random.Random(2), counts, actions=[pause], gap_s=(0, 0.001)
        )
    )
    while counts["pauses"] < 40:
        await asyncio.sleep(0.001)
    stop.set()
    await nemesis
    assert set(pause.targets) == {0, 1}


def test_connection_kills_only_where_there_is_a_database(tmp_path: Path) -> None:
    names = {a.name for a in ACTIONS if a.applies(cluster(tmp_path))}
    assert names == {"kills", "pauses"}
    with_database = {a.name for a in ACTIONS if a.applies(cluster(tmp_path, database="db"))}
    assert with_database == {"kills", "pauses", "connection kills"}

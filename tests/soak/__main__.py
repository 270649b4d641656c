"""`python -m tests.soak --duration 300` (what `make soak DURATION=300` runs): the long soak,
on SQLite, then on PostgreSQL, then on a Patroni cluster whose primary fails over (where
Patroni and etcd are installed), each for the duration given; prints the counts and every
violation, and exits 1 when there is any."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
from pathlib import Path

from tests.soak.run import SoakConfig, available_stores, soak


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds per store")
    parser.add_argument(
        "--stores",
        default=",".join(available_stores()),
        help="sqlite,postgresql,patroni (patroni where Patroni and etcd are installed)",
    )
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--durability", default="strict", choices=["strict", "relaxed"])
    parser.add_argument(
        "--gap", default="1,4", help="LOW,HIGH: quiet seconds before each fault, drawn evenly"
    )
    args = parser.parse_args()
    # The tool's answers to a gateway killed mid-call cannot be written; aiohttp logs each
    # with a traceback. Expected here, and the history says what happened.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    low, high = args.gap.split(",")
    failed = False
    for store in args.stores.split(","):
        with tempfile.TemporaryDirectory(prefix=f"soak-{store}-") as workdir:
            config = SoakConfig(
                store=store.strip(),
                duration_s=args.duration,
                workdir=Path(workdir),
                clients=args.clients,
                seed=args.seed,
                nemesis_gap_s=(float(low), float(high)),
                durability=args.durability,
            )
            report = asyncio.run(soak(config))
        print(report.text(), flush=True)
        failed = failed or bool(report.violations)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

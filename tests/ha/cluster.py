"""A real high-availability PostgreSQL for tests: one etcd and PostgreSQL 15 nodes under
Patroni, on free loopback ports in a temporary folder, run as the `postgres` user (PostgreSQL
refuses to run as root).

Timings are tight (`ttl` 10, `loop_wait` 1, `retry_timeout` 4) so that a switchover gives a
writable primary in a few seconds and a killed primary is replaced in about fifteen. The
helpers act on the cluster as an operator or a fault would: a planned switchover through
Patroni's REST API, a kill -9 of the primary's Patroni and postmaster, a standby made to lag
(SIGSTOP of the primary's walsender to it and of its walreceiver: the walreceiver alone would
lose nothing, the WAL already being in its socket buffers), and Patroni's dynamic
configuration (synchronous mode on and off).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PG_BIN = Path("/usr/lib/postgresql/15/bin")
PATRONI = shutil.which("patroni") or "/usr/bin/patroni"
ETCD = shutil.which("etcd") or "/usr/bin/etcd"
SCOPE = "fgha"
MISSING = "patroni, etcd or PostgreSQL 15 is not installed (apt-get install patroni etcd-server)"


def available() -> bool:
    return all(Path(p).exists() for p in (PATRONI, ETCD, PG_BIN / "postgres"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _as_postgres() -> dict[str, Any]:
    entry = pwd.getpwnam("postgres")
    return {"user": entry.pw_uid, "group": entry.pw_gid} if os.getuid() == 0 else {}


def _http(method: str, url: str, body: Any = None, timeout: float = 3.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as exc:
        text, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


@dataclass
class Node:
    name: str
    pg_port: int
    api_port: int
    home: Path
    process: subprocess.Popen[bytes] | None = None
    log: Any = None

    @property
    def data_dir(self) -> Path:
        return self.home / "data"

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.pg_port}"

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None


@dataclass
class Cluster:
    """`size` nodes; `url(db)` is a libpq multi-host URL naming all of them."""

    root: Path
    size: int = 2
    synchronous: bool = False
    nodes: list[Node] = field(default_factory=list)
    etcd: subprocess.Popen[bytes] | None = None
    etcd_port: int = 0

    # -- life cycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 90.0) -> None:
        owner = _as_postgres()
        if owner:
            os.chown(self.root, owner["user"], owner["group"])
        self.etcd_port, peer = free_port(), free_port()
        etcd_log = open(self.root / "etcd.log", "wb")  # noqa: SIM115 - closed with the cluster
        self.etcd = subprocess.Popen(
            [
                ETCD,
                "--name=e0",
                f"--data-dir={self.root / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=e0=http://127.0.0.1:{peer}",
                "--log-level=error",
            ],
            stdout=etcd_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **owner,
        )
        self._wait(lambda: _http("GET", f"http://127.0.0.1:{self.etcd_port}/health")[0] == 200, 20)
        for i in range(self.size):
            home = self.root / f"node{i}"
            home.mkdir()
            if owner:
                os.chown(home, owner["user"], owner["group"])
            node = Node(f"node{i}", free_port(), free_port(), home)
            self.nodes.append(node)
            self._write_config(node)
        self.start_node(self.nodes[0])
        self.wait_primary(timeout)
        for node in self.nodes[1:]:
            self.start_node(node)
        self.wait_streaming(self.size - 1, timeout)

    def _write_config(self, node: Node) -> None:
        config = {
            "scope": SCOPE,
            "name": node.name,
            "restapi": {"listen": f"127.0.0.1:{node.api_port}", "connect_address": node.api[7:]},
            "etcd3": {"hosts": f"127.0.0.1:{self.etcd_port}"},
            "log": {"level": "WARNING", "dir": str(node.home)},
            "bootstrap": {
                "dcs": {
                    "ttl": 10,
                    "loop_wait": 1,
                    "retry_timeout": 4,
                    "maximum_lag_on_failover": 1 << 30,
                    "synchronous_mode": self.synchronous,
                    "synchronous_mode_strict": self.synchronous,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "parameters": {
                            "wal_log_hints": "on",
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "wal_keep_size": "64MB",
                            "max_connections": 60,
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}],
            },
            "postgresql": {
                "listen": node.address,
                "connect_address": node.address,
                "data_dir": str(node.data_dir),
                "bin_dir": str(PG_BIN),
                "pgpass": str(node.home / "pgpass"),
                "pg_hba": [
                    "local all all trust",
                    "host all all 127.0.0.1/32 trust",
                    "host replication all 127.0.0.1/32 trust",
                ],
                "authentication": {
                    "superuser": {"username": "postgres", "password": "postgres"},
                    "replication": {"username": "replicator", "password": "replicator"},
                },
                "parameters": {
                    "unix_socket_directories": str(node.home),
                    "fsync": "off",  # a test cluster: speed, not crash safety of the disk
                    "shared_buffers": "16MB",
                },
                "remove_data_directory_on_rewind_failure": True,
                "remove_data_directory_on_diverged_timelines": True,
            },
        }
        path = node.home / "patroni.yml"
        path.write_text(json.dumps(config))  # YAML is a superset of JSON
        owner = _as_postgres()
        if owner:
            os.chown(path, owner["user"], owner["group"])

    def start_node(self, node: Node) -> None:
        node.log = open(node.home / "patroni.out", "ab")  # noqa: SIM115 - closed in stop_node
        node.process = subprocess.Popen(
            [PATRONI, str(node.home / "patroni.yml")],
            stdout=node.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **_as_postgres(),
        )

    def stop_node(self, node: Node) -> None:
        """kill -9 of the node's Patroni, its postmaster and every process of it, as when
        its machine fails (a walsender left alive would still send what it holds)."""
        pid = node.postmaster_pid()
        if node.process is not None and node.process.poll() is None:
            node.process.kill()
            node.process.wait()
        if pid is not None:
            children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
            for victim in [pid, *map(int, children.stdout.split())]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
            self._wait(lambda: not _alive(pid), 10)
        if node.log is not None:
            node.log.close()
            node.log = None
        node.process = None

    def close(self) -> None:
        for node in self.nodes:
            self.stop_node(node)
        self._kill_strays()
        if self.etcd is not None:
            self.etcd.kill()
            self.etcd.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    def _kill_strays(self) -> None:
        """Any postgres process left that belongs to this cluster's folder (a backend of a
        killed postmaster that has not noticed yet)."""
        out = subprocess.run(["pgrep", "-f", str(self.root)], capture_output=True, text=True)
        for line in out.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(line), signal.SIGKILL)

    # -- state --------------------------------------------------------------------------------

    def url(self, database: str = "postgres", nodes: list[Node] | None = None) -> str:
        hosts = ",".join(n.address for n in (nodes or self.nodes))
        return f"postgresql://postgres@{hosts}/{database}"

    def members(self) -> list[dict[str, Any]]:
        for node in self.nodes:
            if node.process is None:
                continue
            with contextlib.suppress(OSError):
                status, body = _http("GET", f"{node.api}/cluster", timeout=2)
                if status == 200 and isinstance(body, dict):
                    return list(body.get("members", []))
        return []

    def primary(self) -> Node | None:
        """The node Patroni calls the leader and whose PostgreSQL accepts writes."""
        for member in self.members():
            if member.get("role") == "leader" and member.get("state") == "running":
                node = self.node(member["name"])
                if node.process is not None and self._writable(node):
                    return node
        return None

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def sync_standby(self, timeout: float = 30.0) -> Node:
        """The standby Patroni made synchronous (under synchronous_mode)."""
        found: list[Node] = []

        def named() -> bool:
            found.extend(
                self.node(m["name"]) for m in self.members() if m.get("role") == "sync_standby"
            )
            return bool(found)

        self._wait(named, timeout)
        return found[0]

    def standbys(self) -> list[Node]:
        leader = self.primary()
        return [n for n in self.nodes if n is not leader and n.process is not None]

    def wait_primary(self, timeout: float = 60.0, other_than: Node | None = None) -> Node:
        found: list[Node] = []

        def ready() -> bool:
            node = self.primary()
            if node is None or node is other_than:
                return False
            found.append(node)
            return True

        self._wait(ready, timeout)
        return found[-1]

    def wait_streaming(self, count: int, timeout: float = 60.0) -> None:
        """Until `count` standbys are up and stream from the primary (a standby still being
        copied by pg_basebackup has a walsender too: its name is not the node's)."""

        def streaming() -> bool:
            primary = self.primary()
            if primary is None:
                return False
            rows = self.sql(
                primary,
                "SELECT application_name FROM pg_stat_replication WHERE state = 'streaming'",
            )
            names = {row[0] for row in rows}
            up = [n for n in self.nodes if n.name in names and n.process is not None]
            return len(up) >= count and all(self.sql(n, "SELECT 1") == [["1"]] for n in up)

        self._wait(streaming, timeout)

    def create_database(self, name: str, timeout: float = 30.0) -> None:
        """A database on the primary, once every running standby has it too."""
        self.sql(self.wait_primary(), f"CREATE DATABASE {name}")
        query = f"SELECT 1 FROM pg_database WHERE datname = '{name}'"
        self._wait(lambda: all(self.sql(n, query) == [["1"]] for n in self.standbys()), timeout)

    def drop_database(self, name: str) -> None:
        self.sql(self.wait_primary(), f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def _writable(self, node: Node) -> bool:
        rows = self.sql(node, "SELECT pg_is_in_recovery()")
        return rows == [["f"]]

    def sql(self, node: Node, statement: str, database: str = "postgres") -> list[list[str]]:
        """One statement through psql on the node's socket; its rows ([] when it failed)."""
        out = subprocess.run(
            [
                str(PG_BIN / "psql"),
                "-h",
                str(node.home),
                "-p",
                str(node.pg_port),
                "-U",
                "postgres",
                "-d",
                database,
                "-AtX",
                "-F",
                "\t",
                "-c",
                statement,
            ],
            capture_output=True,
            text=True,
            timeout=10,
            **_as_postgres(),
        )
        if out.returncode != 0:
            return []
        return [line.split("\t") for line in out.stdout.splitlines()]

    # -- what operators and faults do -----------------------------------------------------------

    def switchover(self, timeout: float = 60.0) -> tuple[Node, Node]:
        """A planned switchover to a standby; (old, new) primaries once the new one writes."""
        old = self.wait_primary(timeout)
        # under synchronous_mode Patroni switches over to the synchronous standby only
        candidate = self.sync_standby() if self.synchronous else self.standbys()[0]
        answers: list[Any] = []

        def accepted() -> bool:  # 412 until Patroni has seen the candidate healthy
            status, body = _http(
                "POST",
                f"{old.api}/switchover",
                {"leader": old.name, "candidate": candidate.name},
                timeout=30,
            )
            answers.append((status, body))
            return status == 200

        try:
            self._wait(accepted, 30)
        except TimeoutError:
            raise RuntimeError(f"switchover refused: {answers[-1]}") from None
        return old, self.wait_primary(timeout, other_than=old)

    def kill_primary(self) -> Node:
        """kill -9 of the primary's Patroni and postmaster; the node stays down."""
        old = self.wait_primary()
        self.stop_node(old)
        return old

    def rejoin(self, node: Node, timeout: float = 90.0) -> None:
        """Start a stopped node's Patroni again: it rejoins as a standby (rewound if need be)."""
        self.start_node(node)
        self.wait_streaming(sum(1 for n in self.nodes if n.process is not None) - 1, timeout)

    def set_config(self, **dcs: Any) -> None:
        """Patroni's dynamic configuration (PATCH /config), e.g. synchronous_mode=False."""
        primary = self.wait_primary()
        status, body = _http("PATCH", f"{primary.api}/config", dcs)
        if status != 200:
            raise RuntimeError(f"config refused: {status} {body}")

    def wait_sync_standby(self, present: bool, timeout: float = 30.0) -> None:
        """Until the primary has (or has not) a synchronous standby configured."""

        def settled() -> bool:
            primary = self.primary()
            if primary is None:
                return False
            rows = self.sql(primary, "SHOW synchronous_standby_names")
            return bool(rows) and (rows[0][0] not in ("", None)) == present

        self._wait(settled, timeout)

    @contextlib.contextmanager
    def lagging(self, standby: Node) -> Iterator[None]:
        """The standby receives nothing while inside: the primary's walsender to it and its
        walreceiver are stopped (SIGSTOP), and resumed (SIGCONT) on leaving."""
        primary = self.wait_primary()
        sender = self.sql(
            primary,
            f"SELECT pid FROM pg_stat_replication WHERE application_name = '{standby.name}'",
        )
        receiver = self.sql(standby, "SELECT pid FROM pg_stat_wal_receiver")
        if not sender or not receiver:
            raise RuntimeError(f"{standby.name} does not stream from {primary.name}")
        pids = [int(sender[0][0]), int(receiver[0][0])]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    @staticmethod
    def _wait(condition: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                if condition():
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster did not settle within {timeout}s")
            time.sleep(0.2)


def _alive(pid: int) -> bool:
    """Running, and not a zombie nobody has reaped yet."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def make_root() -> Path:
    return Path(tempfile.mkdtemp(prefix="fg-ha-", dir="/tmp"))

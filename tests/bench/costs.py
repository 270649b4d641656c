"""What a fenced call costs the gateway's CPU, by part, in instructions (callgrind).

Instruction counts do not depend on the load beside them, so they compare across runs and
machines where calls/s do not. Two measurements:

* the whole call: `python -m gateway serve` under callgrind, as the bench runs it (strict,
  JSON log lines at INFO), its counters zeroed after a warm-up, then `CALLS` fenced POSTs from
  wrk, then dumped: instructions per call of every thread of the process; the peer
  (tests/bench/peer.py) counted the same way, the yardstick the calls/s are measured against;
* the parts: this module run under callgrind (`parts`) with the gateway's own functions called
  in process on the same app (`create_app`): each part runs `CALLS` times between two
  `os.getppid()` calls, and callgrind dumps its counters before each of those
  (`--dump-before=getppid`; nothing else calls it), so each dump is one part.

The parts: checks (route, the headers, the rule, the key and fingerprint, the admission
record), admission (`store.admit`, the hand-off to the writer thread, its SQLite statements
and commit, eight calls at a time as under load), upstream (send to the bench's tool, in its
own process, and read its answer), outcome (`store.complete`, eight at a time), headers (what
the tool and the client are told), log (the call's log line, until written), metrics. What
the whole call costs beyond their sum is the server: the front (gateway.wire.front: the head's
parse, the request and its reply), the middlewares, the event loop, the body's read and the
answer's write.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
QUICK = os.environ.get("BENCH_QUICK", "") not in ("", "0")
CALLS = int(os.environ.get("BENCH_COST_CALLS", "100" if QUICK else "300"))
GROUP = 8  # store operations in flight at once, as a batch under load holds several
PARTS = ("checks", "admission", "upstream", "outcome", "headers", "log", "metrics")
_TOTALS = re.compile(rb"^totals: (\d+)", re.MULTILINE)


def available() -> bool:
    return shutil.which("valgrind") is not None and shutil.which("callgrind_control") is not None


def _whole_process(out: Path) -> list[str]:
    """callgrind for a serving process: counters zeroed and dumped from outside it."""
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-instr=no"]


def _valgrind(out: Path) -> list[str]:
    """callgrind for `parts`: a dump before each `os.getppid()`."""
    return [*_whole_process(out), "--dump-before=getppid", "--compress-strings=no"]


def _totals(path: Path) -> int:
    match = _TOTALS.search(path.read_bytes())
    if match is None:
        raise RuntimeError(f"no totals in {path}")
    return int(match.group(1))


# -- the parts, in process (under callgrind) ---------------------------------------------------


async def _parts(tool: str, calls: int, workdir: Path) -> None:
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request
    from multidict import CIMultiDict

    from gateway.config.policy_files import load_policies
    from gateway.config.settings import Settings
    from gateway.core import idempotency
    from gateway.observe import logs
    from gateway.proxy import appkeys, checks, headers
    from gateway.proxy.flow import Flow
    from gateway.proxy.forward import _FENCED_DROP
    from gateway.proxy.relay import admitted_headers, read_head, upstream_headers
    from gateway.proxy.route import route
    from gateway.server.app import create_app
    from gateway.server.middleware import _count
    from tests.harness import make_policy, write_policy

    policy = write_policy(
        workdir / "policy.yaml",
        make_policy(tool + "/api", [{"match": "par/*", "idempotency": {"retention_s": 30}}]),
    )
    settings = Settings(
        database_url=f"sqlite:///{workdir / 'parts.db'}",
        durability="strict",
        policies=str(policy),
        sweep_interval_s=3600,
        log_format="json",
        log_level="INFO",
    )
    logs.configure("json", "INFO")
    app = create_app(settings, load_policies(policy))
    runner = web.AppRunner(app)
    await runner.setup()  # the store and the upstream pool open, as when serving
    store, upstreams, policies = app[appkeys.STORE], app[appkeys.UPSTREAMS], app[appkeys.POLICIES]
    metrics = app[appkeys.METRICS]
    upstream = policies.upstreams["tool"]
    loop = asyncio.get_running_loop()

    def request(n: int) -> tuple[web.Request, bytes]:
        body = b'{"run": "costs", "n": %d}' % n
        hdrs = CIMultiDict(
            {
                "Host": "127.0.0.1",
                "Content-Type": "application/json",
                "Content-Length": str(len(body)),
                "X-Lease-Resource": "par/hot",
                "X-Fence-Token": "1",
            }
        )
        req = make_mocked_request("POST", "/tool/act", headers=hdrs, app=app)
        req[appkeys.REQUEST_ID] = headers.new_request_id()
        return req, body

    async def run(count: int, first: int) -> None:
        requests = [request(first + n) for n in range(count)]
        flows: list[Flow] = []
        os.getppid()  # ---- checks
        for req, body in requests:
            found = route(req, policies)
            flow = Flow(
                req[appkeys.REQUEST_ID],
                upstream=found.upstream,
                method=req.method,
                rest=found.rest,
                request_target=found.request_target,
            )
            rule = checks.rule_of(req, flow, found.upstream)
            flow.fence = headers.parse_fence(req.headers)
            flow.owner = headers.parse_owner(req.headers)
            key = headers.parse_idempotency_key(req.headers) or idempotency.derived_key(
                flow.resource or "", flow.method, flow.request_target, body
            )
            checks.check_signature(req, rule, flow)
            flow.admission(
                rule,
                key,
                idempotency.fingerprint(flow.method, flow.request_target, body),
                rule.idempotency.retry_statuses,
                False,
            )
            flows.append(flow)
        os.getppid()  # ---- admission
        for start in range(0, count, GROUP):
            group = flows[start : start + GROUP]
            for flow, admitted in zip(
                group, await _gather(store.admit(f.call) for f in group), strict=True
            ):
                flow.admitted = admitted
        os.getppid()  # ---- upstream
        outcomes = []
        for (_, body), flow in zip(requests, flows, strict=True):
            sent = CIMultiDict({"Host": upstream.authority, "Content-Type": "application/json"})
            answer = await upstreams.send(
                upstream, "POST", flow.rest, sent, body, loop.time() + 5, may_send=lambda: True
            )
            async with answer:
                head = await read_head(answer, 65536, loop.time() + 5)
            outcomes.append(head.outcome(time.time()))
        os.getppid()  # ---- outcome
        for start in range(0, count, GROUP):
            pairs = list(
                zip(flows[start : start + GROUP], outcomes[start : start + GROUP], strict=True)
            )
            await _gather(store.complete(f.receipt_id or "", o) for f, o in pairs)
        os.getppid()  # ---- headers
        for (req, _), flow in zip(requests, flows, strict=True):
            call = flow.call
            assert call is not None and flow.rule is not None and flow.upstream is not None
            upstream_headers(
                req,
                flow.upstream,
                _FENCED_DROP,
                admitted_headers(
                    flow.rule,
                    call.resource,
                    call.fence,
                    call.idempotency_key,
                    flow.receipt_id or "",
                    flow.request_id,
                ),
                settings.trusted_networks,
            )
            flow.answer_headers(flow.receipt_id or "")
        os.getppid()  # ---- log
        for (req, _), flow in zip(requests, flows, strict=True):
            fields = flow.log_fields()
            logs.event(
                "call",
                request_id=flow.request_id,
                receipt_id=flow.receipt_id,
                client=None,
                resource=fields["resource"],
                fence=fields["fence"],
                upstream=fields["upstream"],
                method=req.method,
                path=req.path,
                status=200,
                code=None,
                duration_ms=1.23,
            )
        logs.flush()  # until every line is written: the writing counts too
        os.getppid()  # ---- metrics
        for flow in flows:
            metrics.admission.observe(0.001)
            metrics.upstream_of(upstream.name).observe(0.001)
            _count(requests[0][0], None, flow.log_fields(), False)
        os.getppid()  # ---- end
        assert all(o.status == "succeeded" for o in outcomes), outcomes[:1]

    await run(GROUP * 4, 0)  # warm-up: imports, the first connection, the caches
    await run(calls, 10**6)
    await runner.cleanup()


async def _gather(aws: Any) -> list[Any]:
    return list(await asyncio.gather(*aws))


def parts(tool: str, calls: int) -> dict[str, float]:
    """Run `_parts` under callgrind: instructions per call of each part."""
    with tempfile.TemporaryDirectory(prefix="fence-costs-") as tmp:
        out = Path(tmp) / "parts.out"
        subprocess.run(
            [*_valgrind(out), sys.executable, "-m", "tests.bench.costs", "parts", tool, str(calls)],
            check=True,
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # one numbered dump per os.getppid(), holding what ran since the one before (the
        # last, at exit, is unnumbered): the measured run's parts are the last len(PARTS)
        dumps = sorted(Path(tmp).glob("parts.out.*"), key=lambda p: int(p.suffix[1:]))
        measured = dumps[-len(PARTS) :]
        return {name: _totals(path) / calls for name, path in zip(PARTS, measured, strict=True)}


async def _counted_calls(url: str, pid: int, calls: int) -> int:
    """Fenced POSTs to the process `pid` at `url`, which runs under callgrind: its counters
    zeroed after 100 calls, dumped after `calls` more. Returns the calls answered."""
    from tests.bench import wrk

    run = os.urandom(4).hex()

    async def load(n: int, word: str) -> int:
        args = ("/tool/act", run + word, "par/hot", "1", str(n))
        result = await wrk.run(url, connections=4, seconds=3600, script="fenced.lua", args=args)
        await asyncio.sleep(2)  # the calls cut off at the limit finish
        if result.errors:
            raise RuntimeError(f"{result.errors} errors under callgrind")
        return result.requests

    await load(100, "w")
    _control("--zero", pid)
    done = await load(calls, "m")
    _control("--dump", pid)
    return done


def _dumped(root: Path, name: str) -> int:
    """The instructions of the dump `_counted_calls` asked for (the largest numbered one)."""
    dumps = [p for p in root.glob(f"{name}.*") if p.stat().st_size]
    return max(_totals(p) for p in dumps)


async def whole(tool: str, calls: int) -> float:
    """Instructions per fenced call of the whole gateway process under callgrind."""
    from tests.harness import GatewayProcess, make_policy, write_policy

    with tempfile.TemporaryDirectory(prefix="fence-costs-") as tmp:
        root = Path(tmp)
        policy = write_policy(
            root / "policy.yaml",
            make_policy(tool + "/api", [{"match": "par/*", "idempotency": {"retention_s": 30}}]),
        )
        gateway = GatewayProcess(
            root,
            policy,
            sweep_interval_s=30,  # the calls are slow under callgrind: no sweep among them
            extra_env={
                "GATEWAY_DURABILITY": "strict",
                "GATEWAY_LOG_FORMAT": "json",
                "GATEWAY_LOG_LEVEL": "INFO",
            },
            ready_timeout=600,
            wrapper=_whole_process(root / "whole.out"),
        )
        await gateway.start()
        try:
            assert gateway.proc is not None
            done = await _counted_calls(gateway.url, gateway.proc.pid, calls)
        finally:
            await gateway.terminate()
        return _dumped(root, "whole.out") / done


async def peer_whole(tool: str, calls: int) -> float:
    """Instructions per call of the peer (tests/bench/peer.py), counted as `whole` counts
    the gateway's: what the same call costs through the proxy a user would write instead."""
    with tempfile.TemporaryDirectory(prefix="fence-costs-") as tmp:
        root = Path(tmp)
        proc = await asyncio.create_subprocess_exec(
            *_whole_process(root / "peer.out"),
            sys.executable,
            "-m",
            "tests.bench.peer",
            tool,
            cwd=REPO_ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            assert proc.stdout is not None
            port = int(await asyncio.wait_for(proc.stdout.readline(), 600))
            done = await _counted_calls(f"http://127.0.0.1:{port}", proc.pid, calls)
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            await proc.wait()
        return _dumped(root, "peer.out") / done


def _control(option: str, pid: int) -> None:
    subprocess.run(
        ["callgrind_control", option, str(pid)], check=True, stdout=subprocess.DEVNULL, timeout=120
    )


async def table(tool: str) -> list[list[str]]:
    """Rows of the cost table: part, instructions per call, share of the whole; then the
    peer's whole call, and its share of the gateway's."""
    total = await whole(tool, CALLS)
    by_part = await asyncio.to_thread(parts, tool, CALLS)
    rows = [
        [name, f"{value / 1000:.0f}", f"{value / total:.0%}"] for name, value in by_part.items()
    ]
    server = total - sum(by_part.values())
    rows.append(["server (the rest: the front, middlewares, loop)", f"{server / 1000:.0f}",
                 f"{server / total:.0%}"])  # fmt: skip
    rows.append(["whole call", f"{total / 1000:.0f}", "100%"])
    peer = await peer_whole(tool, CALLS)
    rows.append(["the peer's whole call (no store, no log line)", f"{peer / 1000:.0f}",
                 f"{peer / total:.0%}"])  # fmt: skip
    return rows


async def _main() -> None:
    from tests.bench.__main__ import process

    async with process("tests.bench.upstream") as tool:
        for row in await table(tool):
            print(" | ".join(row))


if __name__ == "__main__":
    if sys.argv[1:2] == ["parts"]:
        with tempfile.TemporaryDirectory(prefix="fence-costs-parts-") as tmp:
            asyncio.run(_parts(sys.argv[2], int(sys.argv[3]), Path(tmp)))
    else:
        asyncio.run(_main())

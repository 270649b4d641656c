"""Sweeper cleanup (docs/contract.md §9): a rule's `on_expiry` call after a lease expired untaken.

Why it is shaped this way:

* **Nothing is forgotten.** The store writes an owed cleanup in the same transaction that
  marks the lease expired, and deletes it only when the call is known to have happened
  (succeeded, or reconciled `applied`/`compensated`) or a new owner took the resource over.
  A failed call (`not_sent`, non-2xx, refused) is tried again at a later sweep, with backoff;
  an `outcome_unknown` one waits, untouched, until a reconciler (or a late outcome) settles
  its receipt. A restart picks up where the last run stopped.
* **Once, even with several sweepers.** Each attempt is claimed in one store transaction
  that re-reads the owed row and the earlier attempt's receipt and takes the resource with
  the acquire CAS, as owner `gateway-sweeper:{instance}`. Only the claim's winner calls.
* **Like any call.** The sweeper's lease has a new fence, so the former owner is fenced out
  before anything is sent; the call goes through `store.admit` (own receipt, key
  `gw-sweep-{fence}`), waits in the resource's place behind older calls, is sent once, and its
  outcome is recorded before the lease is released.
* **Off the sweep loop.** A cleanup call may take the upstream's whole `timeout_s`; it runs
  as its own task (one per resource) so heartbeats and expiry keep their pace.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from aiohttp import web

from gateway.config.policy import ResourceRule, Upstream
from gateway.core import errors, idempotency
from gateway.core.leases import SWEEPER_OWNER_PREFIX, sweeper_owner
from gateway.observe import logs
from gateway.proxy import appkeys
from gateway.proxy.flow import Flow
from gateway.proxy.forward import admit, forward, take_turn
from gateway.proxy.headers import new_request_id
from gateway.store.base import Admitted, CleanupClaim, Outcome, Refused

MAX_RETRY_S = 60.0  # the longest wait between two tries of a failing cleanup
MIN_RECHECK_S = 1.0  # how often an unknown outcome or a held resource is looked at again
DUE_PER_SWEEP = 100  # owed cleanups started by one sweep at most


class Cleaner:
    """Starts the owed cleanups that are due; one task per resource at a time."""

    def __init__(self, app: web.Application) -> None:
        self._app = app
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def owed_after(self, resource: str, owner: str) -> float | None:
        """For the store, inside its transaction: a lease of `owner` on `resource` expired;
        the lock delay after which its cleanup is due, or None when none is owed. The
        sweeper's own expired lease owes none: its attempt's row is still there."""
        if owner.startswith(SWEEPER_OWNER_PREFIX):
            return None
        rule = self._app[appkeys.POLICIES].lease_rule(resource)
        if rule is None or rule.on_expiry is None:
            return None
        return rule.lease.lock_delay_s

    async def start_due(self) -> None:
        store = self._app[appkeys.STORE]
        for resource in await store.due_cleanups(DUE_PER_SWEEP):
            if resource not in self._tasks:
                task = asyncio.create_task(self._clean(resource), name=f"cleanup {resource}")
                self._tasks[resource] = task
                task.add_done_callback(functools.partial(self._forget, resource))

    def _forget(self, resource: str, _task: asyncio.Task[None]) -> None:
        self._tasks.pop(resource, None)

    async def close(self, grace_s: float) -> None:
        """Let cleanups in flight finish (and record their outcomes) for up to `grace_s`."""
        tasks = list(self._tasks.values())
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=grace_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _clean(self, resource: str) -> None:
        try:
            await self._attempt(resource)
        except errors.StoreUnavailable as exc:
            logs.event("cleanup_store_failed", logging.WARNING, resource=resource, error=str(exc))
        except Exception:
            logs.log.exception("cleanup of %s failed unexpectedly", resource)

    async def _attempt(self, resource: str) -> None:
        app = self._app
        settings, store, policies = app[appkeys.SETTINGS], app[appkeys.STORE], app[appkeys.POLICIES]
        rule = policies.lease_rule(resource)
        if rule is None or rule.on_expiry is None:
            await store.drop_cleanup(resource)
            logs.event(
                "cleanup_dropped",
                logging.WARNING,
                resource=resource,
                detail="the resource's rule no longer has on_expiry",
            )
            return
        upstream = policies.upstreams[rule.upstream]
        owner = sweeper_owner(settings.instance_id)
        claim = await store.claim_cleanup(
            resource,
            owner,
            upstream.timeout_s + settings.reconcile_grace_s + rule.lease.ttl_s,
            rule.lease.lock_delay_s,
            max(settings.sweep_interval_s, MIN_RECHECK_S),
        )
        if claim.state == "done":
            logs.event("cleanup_settled", resource=resource, receipt_id=claim.receipt_id)
        elif claim.state == "superseded":
            logs.event(
                "cleanup_superseded",
                resource=resource,
                holder=claim.holder,
                detail="a new owner took the resource before its cleanup ran",
            )
        if claim.state != "claimed" or claim.fence is None or claim.key is None:
            return
        fence = claim.fence
        try:
            outcome, receipt_id = await self._call(
                rule, upstream, resource, fence, claim.key, owner
            )
            await self._settle(rule, upstream, resource, claim, outcome, receipt_id)
        finally:  # also when cancelled at shutdown: the resource is free again at once
            await self._release(resource, owner, fence)

    async def _settle(
        self,
        rule: ResourceRule,
        upstream: Upstream,
        resource: str,
        claim: CleanupClaim,
        outcome: Outcome,
        receipt_id: str | None,
    ) -> None:
        """Note the attempt's result on the owed row, then log and count it: what the metric
        and the log tell is what the store holds."""
        settings, store = self._app[appkeys.SETTINGS], self._app[appkeys.STORE]
        fence = claim.fence or 0
        result = _result_of(outcome)
        fields = {
            "resource": resource,
            "fence": fence,
            "expired_fence": claim.lease_fence,
            "expired_owner": claim.lease_owner,
            "attempt": claim.attempt,
            "receipt_id": receipt_id,
            "upstream": upstream.name,
            "method": rule.on_expiry.method if rule.on_expiry else None,
            "status": outcome.http_status,
            "error": outcome.error,
        }
        if result == "succeeded":
            await store.finish_cleanup(resource, fence, done=True)
            logs.event("cleanup_succeeded", **fields)
        elif result == "unknown":
            await store.finish_cleanup(resource, fence, done=False, error="outcome_unknown")
            logs.event(
                "cleanup_outcome_unknown",
                logging.ERROR,
                **fields,
                detail="waiting for the receipt to be reconciled",
            )
        else:
            doublings = min(claim.attempt - 1, 64)  # 2.0 ** 1024 is past a float
            retry_in = min(settings.sweep_interval_s * 2.0**doublings, MAX_RETRY_S)
            await store.finish_cleanup(
                resource,
                fence,
                done=False,
                retry_at=time.time() + retry_in,
                error=outcome.error or f"http_{outcome.http_status}",
            )
            logs.event("cleanup_failed", logging.ERROR, **fields, retry_in_s=retry_in)
        self._app[appkeys.METRICS].cleanups.labels(result).inc()

    async def _call(
        self,
        rule: ResourceRule,
        upstream: Upstream,
        resource: str,
        fence: int,
        key: str,
        owner: str,
    ) -> tuple[Outcome, str | None]:
        """The on_expiry call through the fenced path: place, admit, send once, record."""
        app = self._app
        template = rule.on_expiry
        if template is None:
            raise ValueError(f"the rule for {resource!r} has no on_expiry")
        method = template.method
        recorded_path = template.render(resource, fence, key)
        flow = Flow(
            new_request_id(),
            upstream=upstream,
            method=method,
            rest=recorded_path,
            resource=resource,
            fence=fence,
            owner=owner,
            rule=rule,
        )
        # The sweeper is no client: its lease is its own, whatever clients file is configured.
        call = flow.admission(
            rule,
            key,
            idempotency.fingerprint(method, upstream.mount + recorded_path, b""),
            rule.idempotency.retry_statuses,
            clients_configured=False,
        )
        async with app[appkeys.LANES].join(resource) as place:
            try:
                await take_turn(rule, resource, place)
            except errors.ResourceBusy:
                return Outcome("not_sent", error="resource_busy"), None
            result = await admit(app, call, place)
            if isinstance(result, Refused):
                return Outcome("not_sent", error=result.code), result.receipt_id
            if not isinstance(result, Admitted):  # a replay: a fresh fence's key cannot have one
                return Outcome("not_sent", error="replayed"), result.receipt_id
            flow.admitted = result
            flow.rest = template.render(resource, fence, key, result.receipt_id)
            async with forward(app, flow, place, None, None) as exchange:
                return exchange.outcome, result.receipt_id

    async def _release(self, resource: str, owner: str, fence: int) -> None:
        try:
            await self._app[appkeys.STORE].release(resource, owner, fence)
        except errors.StoreUnavailable as exc:  # the lease runs out by itself
            logs.event(
                "cleanup_release_failed",
                logging.WARNING,
                resource=resource,
                fence=fence,
                error=str(exc),
            )


def _result_of(outcome: Outcome) -> str:
    """The cleanups metric's label: succeeded, unknown, or failed (retried later)."""
    if outcome.status == "succeeded":
        return "succeeded"
    if outcome.status == "outcome_unknown":
        return "unknown"
    return "failed"

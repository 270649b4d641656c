"""Prometheus collectors (docs/contract.md §10), named once.

No label ever carries a raw resource key."""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily, Metric

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
)
_HELD_BUCKETS = (0.1, 0.5, 1, 5, 15, 30, 60, 120, 300, 900, 3600, 14400)


class Metrics:
    """One registry per app, so several gateways in one test process do not collide."""

    def __init__(self, replication: str = "async") -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "fence_gateway_requests_total",
            "Proxied calls by result",
            ["upstream", "result"],
            registry=registry,
        )
        self.rejections = Counter(
            "fence_gateway_rejections_total",
            "Calls refused, by code",
            ["upstream", "code"],
            registry=registry,
        )
        self.acquisitions = Counter(
            "fence_gateway_lease_acquisitions_total",
            "Lease acquire attempts",
            ["result"],
            registry=registry,
        )
        self.renewals = Counter(
            "fence_gateway_lease_renewals_total", "Lease renewals", ["result"], registry=registry
        )
        self.held = Histogram(
            "fence_gateway_lease_held_seconds",
            "How long leases were held, on release or expiry",
            buckets=_HELD_BUCKETS,
            registry=registry,
        )
        self.outcome_unknown = Counter(
            "fence_gateway_outcome_unknown_total",
            "Calls whose outcome was lost",
            ["upstream"],
            registry=registry,
        )
        self.outcome_unknown_oldest = Gauge(
            "fence_gateway_outcome_unknown_oldest_seconds",
            "Age of the oldest outcome_unknown receipt",
            registry=registry,
        )
        self.reconciliations = Counter(
            "fence_gateway_reconciliations_total",
            "Receipts reconciled",
            ["outcome", "source"],
            registry=registry,
        )
        self.cleanups = Counter(
            "fence_gateway_sweeper_cleanups_total",
            "Sweeper cleanup calls",
            ["result"],
            registry=registry,
        )
        # from 0, so that the alert's increase() sees a replica's first failed cleanup
        for result in ("succeeded", "failed", "unknown"):
            self.cleanups.labels(result)
        admission = LoopHistograms(
            "fence_gateway_admission_seconds",
            "Admission: checks and the durable commit",
            (),
            _LATENCY_BUCKETS,
            registry,
        )
        self.admission = admission.labels()
        self.upstream = LoopHistograms(
            "fence_gateway_upstream_seconds",
            "Upstream call duration",
            ("upstream",),
            _LATENCY_BUCKETS,
            registry,
        )
        self.sessions_open = Gauge(
            "fence_gateway_sessions_open",
            "Sessions (fenced WebSockets) open now",
            ["upstream"],
            registry=registry,
        )
        self.sessions = Counter(
            "fence_gateway_sessions_total",
            "Sessions ended, by what ended them",
            ["upstream", "closed_by"],
            registry=registry,
        )
        self.ready = Gauge(
            "fence_gateway_ready",
            "1 while this replica's heartbeat reaches the store (and, under "
            "GATEWAY_REPLICATION=sync, finds replication synchronous), 0 while not: what "
            "readyz says",
            registry=registry,
        )
        self.checkpoints = Counter(
            "fence_gateway_checkpoints_total",
            "Checkpoint writes: written, retried (an identical retry), refused, error",
            ["result"],
            registry=registry,
        )
        self.store_epochs = Counter(
            "fence_gateway_store_epochs_total",
            "New store epochs this replica recorded (a failover, a restore), by whether the "
            "fence floor was applied",
            ["floor"],
            registry=registry,
        )
        for floor in ("applied", "not_needed"):  # from 0, so that a rate sees the first one
            self.store_epochs.labels(floor)
        # Only a replica that checks replication exports it: a 0 elsewhere would read as
        # "admits nothing" to the alerting rule (deploy/prometheus/alerts.yaml).
        self.replication_synchronous = (
            Gauge(
                "fence_gateway_replication_synchronous",
                "Under GATEWAY_REPLICATION=sync: 1 while the last check found synchronous "
                "replication, 0 while this replica admits nothing for want of it",
                registry=registry,
            )
            if replication == "sync"
            else None
        )

        # What every proxied call counts with, by label values: the child is made on first
        # use, then found by a dict lookup (`labels()` checks its values and takes a lock).
        self.requests_of = functools.cache(self.requests.labels)
        self.rejections_of = functools.cache(self.rejections.labels)
        self.upstream_of = functools.cache(self.upstream.labels)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LoopHistogram:
    """One histogram's counts, observed on the event loop's thread only: with no lock
    (prometheus-client's histogram takes one for its sum and one for its bucket, and walks
    its buckets in Python, on every call)."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # by bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self._bounds, amount)] += 1  # the first bound >= it
        self.sum += amount


class LoopHistograms:
    """A histogram family of `LoopHistogram`s by label values, registered as a collector:
    the scrape (on the loop too) reads it as prometheus-client's `Histogram` would be read."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        bounds: tuple[float, ...],
        registry: CollectorRegistry,
    ) -> None:
        self._name, self._documentation = name, documentation
        self._labelnames = list(labelnames)
        self._bounds = tuple(map(float, bounds))
        self._children: dict[tuple[str, ...], LoopHistogram] = {}
        registry.register(self)

    def labels(self, *values: str) -> LoopHistogram:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self._name} takes labels {self._labelnames}")
            child = self._children[values] = LoopHistogram(self._bounds)
        return child

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        for values, child in list(self._children.items()):
            cumulative, buckets = 0, []
            # each bound's `le` as prometheus-client writes it: 1.0, 0.0005, +Inf
            for bound, count in zip((*map(repr, self._bounds), "+Inf"), child.counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric(list(values), buckets, child.sum)
        yield family

"""The per-call histograms kept on the loop's thread read as prometheus-client's would."""

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.observe.metrics import LoopHistograms, Metrics

BOUNDS = (0.001, 0.01, 1, 5)
AMOUNTS = (0.0005, 0.001, 0.0011, 0.01, 0.5, 1.0, 5.0, 7.0, 0.0)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_buckets_sum_and_count_as_prometheus_clients_histogram() -> None:
    """A value on a bound counts in that bound's bucket (`le`), above the last in +Inf."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistograms("h_seconds", "h", ("upstream",), BOUNDS, ours)
    reference = Histogram("h_seconds", "h", ["upstream"], buckets=BOUNDS, registry=theirs)
    for amount in AMOUNTS:
        loop.labels("tool").observe(amount)
        reference.labels("tool").observe(amount)
    loop.labels("other").observe(2)
    reference.labels("other").observe(2)
    assert _samples(ours) == _samples(theirs)


def test_the_gateways_histograms_without_observations() -> None:
    """The unlabelled admission histogram is exported from the start, at zero; the upstream
    one by upstream, once an upstream was called."""
    metrics = Metrics()
    samples = _samples(metrics.registry)
    assert samples[("fence_gateway_admission_seconds_count", ())] == 0
    assert not [name for name, _ in samples if name.startswith("fence_gateway_upstream_seconds")]
    metrics.upstream_of("tool").observe(0.002)
    samples = _samples(metrics.registry)
    assert samples[("fence_gateway_upstream_seconds_count", (("upstream", "tool"),))] == 1
    assert (
        samples[("fence_gateway_upstream_seconds_bucket", (("le", "0.0025"), ("upstream", "tool")))]
        == 1
    )

"""Prometheus metrics for every service, on ``prometheus_client``: one helper instead of three renderers.

Each service builds one :class:`Metrics` from a table of :class:`Spec` (name ->
kind, help, label names, buckets) and serves :meth:`Metrics.render` at
``/metrics``. Call sites stay one-liners::

    metrics.inc("swarm_tracker_announces_total")
    metrics.inc("swarm_gateway_rejections_total", reason="queue_full")
    metrics.observe("swarm_gateway_time_to_first_token_seconds", 0.23)
    text = metrics.render({"swarm_gateway_sessions_active": {(): 3.0}})   # gauges read at scrape time

Invariants and bounds
    * Every service has its own ``CollectorRegistry`` (never the global one), so
      several services in one process (tests, benchmarks) do not collide.
    * A name must be declared in the table and called with exactly its label
      names, else :class:`MetricsError` (a typo fails in tests, not silently).
    * Label sets are bounded: each metric keeps at most ``Spec.max_series``
      distinct label combinations; later new combinations are counted under
      every label value ``"other"``.
    * Histograms are in base units (seconds, tokens) and always expose buckets.
    * ``scraped`` specs (counters or gauges whose values live in other objects,
      e.g. a scheduler's statistics) are supplied at render time by the caller
      or by a registered source callback; ``inc``/``observe`` refuse them.
    * Every registry also carries the process collector (CPU, memory, file
      descriptors), the Python platform and GC collectors, and
      ``swarm_build_info{service,version,python}`` = 1.

Threads: call everything from the service's own (trio) thread, except
``observe``/``inc`` of a metric without labels, which may come from any thread
(prometheus_client's instruments lock internally; no bookkeeping of ours runs
for them): the node's engine thread times its batches that way.
"""

from __future__ import annotations

import importlib.metadata
import math
import platform
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import prometheus_client
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# ``*_created`` series double the output and no dashboard here reads them.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

Labels = tuple[tuple[str, str], ...]
ScrapeValues = Mapping[str, Mapping[Labels, float]]
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_PLAIN_0_0_4
OTHER = "other"

# Seconds. Wide enough for a loopback hop (sub-millisecond) and a slow first token on a WAN swarm.
LATENCY_BUCKETS_S: tuple[float, ...] = (
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
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
# Positions (tokens) per engine batch or per request.
TOKEN_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class MetricsError(ValueError):
    """A metric used against its declaration (unknown name, wrong labels, wrong kind)."""


@dataclass(frozen=True)
class Spec:
    kind: Literal["counter", "gauge", "histogram"]
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = LATENCY_BUCKETS_S  # histograms only
    max_series: int = 64  # distinct label combinations kept before "other"
    scraped: bool = False  # values supplied at render time, not by inc/observe/set


def counter(help: str, *labels: str, scraped: bool = False, max_series: int = 64) -> Spec:
    return Spec("counter", help, labels, scraped=scraped, max_series=max_series)


def gauge(help: str, *labels: str, scraped: bool = True, max_series: int = 64) -> Spec:
    return Spec("gauge", help, labels, scraped=scraped, max_series=max_series)


def histogram(help: str, *labels: str, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> Spec:
    return Spec("histogram", help, labels, buckets=buckets)


def software_version() -> str:
    try:
        return importlib.metadata.version("swarm-inference")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a plain checkout
        return "0.0.0"


class _Scraped(Collector):
    """Yields the scrape-time values the current :meth:`Metrics.render` call supplied."""

    def __init__(self, specs: Mapping[str, Spec]) -> None:
        self._specs = {n: s for n, s in specs.items() if s.scraped}
        self.values: ScrapeValues = {}

    def describe(self) -> Iterable[Metric]:
        return []  # values appear only at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        for name, spec in self._specs.items():
            series = self.values.get(name, {})
            family: GaugeMetricFamily | CounterMetricFamily
            if spec.kind == "counter":
                family = CounterMetricFamily(name, spec.help, labels=spec.labels)
            else:
                family = GaugeMetricFamily(name, spec.help, labels=spec.labels)
            kept: set[tuple[str, ...]] = set()
            merged: dict[tuple[str, ...], float] = {}
            for labels, value in series.items():
                got = dict(labels)
                if set(got) != set(spec.labels):
                    raise MetricsError(f"{name}: labels {sorted(got)} != declared {list(spec.labels)}")
                key = tuple(str(got[n]) for n in spec.labels)
                if key not in kept and len(kept) >= spec.max_series:
                    key = tuple(OTHER for _ in spec.labels)
                kept.add(key)
                merged[key] = merged.get(key, 0.0) + float(value)
            for key, value in merged.items():
                family.add_metric(list(key), value)
            yield family


class Metrics:
    """One service's metrics: declared instruments, scrape-time values, process and build info."""

    def __init__(
        self,
        service: str,
        specs: Mapping[str, Spec],
        *,
        process: bool = True,
        sources: Iterable[Callable[[], ScrapeValues]] = (),
    ) -> None:
        self.service = service
        self.specs = dict(specs)
        self.registry = CollectorRegistry(auto_describe=True)
        self._instruments: dict[str, Counter | Gauge | Histogram] = {}
        self._series: dict[str, set[tuple[str, ...]]] = {}
        self._sources = list(sources)
        self._label_values: dict[str, set[str]] = {}
        for name, spec in self.specs.items():
            if spec.scraped:
                if spec.kind == "histogram":
                    raise MetricsError(f"{name}: a histogram cannot be scraped; observe it")
                continue
            if spec.kind == "counter":
                if not name.endswith("_total"):
                    raise MetricsError(f"counter {name} must end in _total")
                self._instruments[name] = Counter(name, spec.help, spec.labels, registry=self.registry)
            elif spec.kind == "gauge":
                self._instruments[name] = Gauge(name, spec.help, spec.labels, registry=self.registry)
            else:
                self._instruments[name] = Histogram(
                    name, spec.help, spec.labels, buckets=spec.buckets, registry=self.registry
                )
            self._series[name] = set()
        self._scraped = _Scraped(self.specs)
        self.registry.register(self._scraped)
        info = Gauge(
            "swarm_build_info",
            "1, labelled with the running software's version",
            ("service", "version", "python"),
            registry=self.registry,
        )
        info.labels(service, software_version(), platform.python_version()).set(1)
        if process:
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            GCCollector(registry=self.registry)

    # --- instruments --------------------------------------------------------------------------

    def _child(self, name: str, labels: Mapping[str, str], kind: str) -> Counter | Gauge | Histogram:
        spec = self.specs.get(name)
        if spec is None:
            raise MetricsError(f"metric {name!r} is not declared")
        if spec.kind != kind or spec.scraped:
            what = "scraped " + spec.kind if spec.scraped else spec.kind
            raise MetricsError(f"metric {name!r} is a {what}, not something to {_VERB[kind]}")
        if set(labels) != set(spec.labels):
            raise MetricsError(f"{name}: labels {sorted(labels)} != declared {list(spec.labels)}")
        instrument = self._instruments[name]
        if not spec.labels:
            return instrument
        key = tuple(str(labels[n]) for n in spec.labels)
        seen = self._series[name]
        if key not in seen:
            if len(seen) >= spec.max_series:
                key = tuple(OTHER for _ in spec.labels)
            seen.add(key)
        return instrument.labels(*key)

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        """Add ``amount`` (>= 0) to a counter."""
        if amount < 0 or math.isnan(amount):
            raise MetricsError(f"{name}: a counter only goes up (got {amount})")
        child = self._child(name, labels, "counter")
        assert isinstance(child, Counter)
        child.inc(amount)

    def observe(self, name: str, value: float, **labels: str) -> None:
        """Record one observation (seconds, tokens) in a histogram."""
        child = self._child(name, labels, "histogram")
        assert isinstance(child, Histogram)
        child.observe(value)

    def set(self, name: str, value: float, **labels: str) -> None:
        """Set a gauge that is pushed rather than read at scrape time."""
        child = self._child(name, labels, "gauge")
        assert isinstance(child, Gauge)
        child.set(value)

    def bounded_label(self, family: str, value: str, limit: int = 64) -> str:
        """``value`` while fewer than ``limit`` distinct values of the label ``family`` were seen,
        else ``"other"``: for label values shared by several metrics (routes), so that pushed
        and scrape-time series agree on which values are kept."""
        seen = self._label_values.setdefault(family, set())
        if value in seen or len(seen) < limit:
            seen.add(value)
            return value
        return OTHER

    def total(self, name: str, **match: str) -> float:
        """Sum of a pushed counter's samples whose labels include ``match`` (0 when none)."""
        total = 0.0
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in match.items()):
                    total += sample.value
        return total

    # --- reading back --------------------------------------------------------------------------

    def value(self, name: str, **labels: str) -> float:
        """The current value of a pushed counter or gauge (0 when never touched)."""
        got = self.registry.get_sample_value(name, labels)
        return 0.0 if got is None else float(got)

    def counter(self, name: str, **labels: str) -> float:
        return self.value(name, **labels)

    def histogram_count(self, name: str, **labels: str) -> int:
        got = self.registry.get_sample_value(name + "_count", labels)
        return 0 if got is None else int(got)

    def histogram_buckets(self, name: str, **labels: str) -> list[tuple[float, float]]:
        """``[(upper bound, cumulative count), ...]`` of a histogram, ending with ``(inf, count)``."""
        spec = self.specs[name]
        out = []
        for le in (*spec.buckets, math.inf):
            key = "+Inf" if math.isinf(le) else prometheus_client.utils.floatToGoString(le)  # type: ignore[no-untyped-call]
            got = self.registry.get_sample_value(name + "_bucket", {**labels, "le": key})
            out.append((le, 0.0 if got is None else float(got)))
        return out

    # --- exposition ----------------------------------------------------------------------------

    def render(self, gauges: ScrapeValues | None = None) -> str:
        """The text exposition (format 0.0.4) with ``gauges`` (and the sources) as scrape-time values."""
        values: dict[str, dict[Labels, float]] = {}
        for source in self._sources:
            for name, series in source().items():
                values.setdefault(name, {}).update(series)
        for name, series in (gauges or {}).items():
            values.setdefault(name, {}).update(series)
        unknown = [n for n in values if n not in self.specs or not self.specs[n].scraped]
        if unknown:
            raise MetricsError(f"scrape-time values for undeclared or pushed metrics: {sorted(unknown)}")
        self._scraped.values = values
        try:
            return prometheus_client.generate_latest(self.registry).decode("utf-8")
        finally:
            self._scraped.values = {}


_VERB = {"counter": "inc", "gauge": "set", "histogram": "observe"}


def quantile_from_buckets(buckets: list[tuple[float, float]], q: float) -> float:
    """Estimate the ``q`` quantile from cumulative ``(upper bound, count)`` pairs, as PromQL's
    ``histogram_quantile`` does (linear inside the bucket); NaN when there are no observations."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le  # in the overflow bucket: the highest finite bound is all we know
            span = count - prev_count
            if span <= 0:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / span
        prev_le, prev_count = le, count
    return prev_le


def bucket_delta(
    now: list[tuple[float, float]], before: list[tuple[float, float]] | None
) -> list[tuple[float, float]]:
    """Cumulative bucket counts observed between two readings of the same histogram."""
    if before is None:
        return list(now)
    return [(le, max(0.0, c - b)) for (le, c), (_, b) in zip(now, before, strict=True)]

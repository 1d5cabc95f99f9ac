"""common.metrics: declarations enforced, label sets bounded, registries separate, output parses."""

from __future__ import annotations

import math
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common import metrics as m
from common.metrics import Metrics, MetricsError, bucket_delta, quantile_from_buckets

SPECS = {
    "t_requests_total": m.counter("requests", "endpoint"),
    "t_latency_seconds": m.histogram("latency"),
    "t_queue": m.gauge("queued now"),
    "t_frames_total": m.counter("frames", "direction", scraped=True),
    "t_routes": m.gauge("per route", "route", max_series=3),
    "t_pushed": m.gauge("set by hand", scraped=False),
}


def _families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_render_parses_and_carries_process_build_info_and_histogram_buckets() -> None:
    metrics = Metrics("svc", SPECS)
    metrics.inc("t_requests_total", endpoint="/a")
    metrics.inc("t_requests_total", 2, endpoint="/a")
    for v in (0.0002, 0.003, 0.2, 100.0):
        metrics.observe("t_latency_seconds", v)
    metrics.set("t_pushed", 7)
    text = metrics.render({"t_queue": {(): 4}, "t_frames_total": {(("direction", "in"),): 10.0}})
    families = _families(text)
    (req,) = [s for s in families["t_requests"].samples if s.name == "t_requests_total"]  # type: ignore[attr-defined]
    assert req.labels == {"endpoint": "/a"} and req.value == 3
    latency = families["t_latency_seconds"]
    assert latency.type == "histogram"  # type: ignore[attr-defined]
    buckets = {s.labels["le"]: s.value for s in latency.samples if s.name.endswith("_bucket")}  # type: ignore[attr-defined]
    assert buckets["0.0005"] == 1 and buckets["0.005"] == 2 and buckets["0.25"] == 3 and buckets["+Inf"] == 4
    assert families["t_queue"].samples[0].value == 4  # type: ignore[attr-defined]
    assert families["t_frames"].type == "counter"  # type: ignore[attr-defined]
    assert families["t_pushed"].samples[0].value == 7  # type: ignore[attr-defined]
    info = families["swarm_build_info"].samples[0]  # type: ignore[attr-defined]
    assert info.labels["service"] == "svc" and info.labels["version"] and info.value == 1
    assert "process_cpu_seconds" in families and "python_gc_objects_collected" in families
    assert "_created" not in text
    # scrape-time values are not remembered: the next render without them has the family, no sample
    later = metrics.render()
    assert "# TYPE t_queue gauge" in later and "\nt_queue " not in later
    assert metrics.histogram_count("t_latency_seconds") == 4
    assert metrics.value("t_requests_total", endpoint="/a") == 3


def test_misuse_is_refused_loudly() -> None:
    metrics = Metrics("svc", SPECS, process=False)
    with pytest.raises(MetricsError, match="not declared"):
        metrics.inc("t_typo_total")
    with pytest.raises(MetricsError, match="labels"):
        metrics.inc("t_requests_total", status="200")
    with pytest.raises(MetricsError, match="only goes up"):
        metrics.inc("t_requests_total", -1, endpoint="/a")
    with pytest.raises(MetricsError, match="histogram"):
        metrics.inc("t_latency_seconds")
    with pytest.raises(MetricsError, match="scraped"):
        metrics.inc("t_frames_total", direction="in")
    with pytest.raises(MetricsError, match="undeclared or pushed"):
        metrics.render({"t_requests_total": {(): 1.0}})
    with pytest.raises(MetricsError, match="labels"):
        metrics.render({"t_frames_total": {(("dir", "in"),): 1.0}})
    with pytest.raises(MetricsError, match="_total"):
        Metrics("bad", {"t_count": m.counter("no suffix")})


def test_label_sets_are_bounded() -> None:
    metrics = Metrics("svc", {"t_hits_total": m.counter("hits", "route", max_series=3)}, process=False)
    for i in range(10):
        metrics.inc("t_hits_total", route=f"r{i}")
    samples = {
        s.labels["route"]: s.value
        for f in text_string_to_metric_families(metrics.render())
        for s in f.samples
        if s.name == "t_hits_total"
    }
    assert samples == {"r0": 1, "r1": 1, "r2": 1, "other": 7}
    # scrape-time series too
    text = metrics.render() + Metrics("svc2", SPECS, process=False).render(
        {"t_routes": {(("route", f"x{i}"),): 1.0 for i in range(5)}}
    )
    routes = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "t_routes"]
    assert len(routes) == 3 + 1 and {s.labels["route"] for s in routes} >= {"other"}
    assert sum(s.value for s in routes) == 5
    # a shared label family
    assert [metrics.bounded_label("route", f"z{i}", limit=2) for i in range(4)] == [
        "z0",
        "z1",
        "other",
        "other",
    ]


def test_registries_are_per_service() -> None:
    a, b = Metrics("a", SPECS, process=False), Metrics("b", SPECS, process=False)
    a.inc("t_requests_total", endpoint="/")
    assert a.value("t_requests_total", endpoint="/") == 1 and b.value("t_requests_total", endpoint="/") == 0
    a.render()
    b.render()  # two ProcessCollectors in one process do not collide either
    Metrics("c", SPECS).render()
    Metrics("d", SPECS).render()


def test_observe_without_labels_from_threads() -> None:
    metrics = Metrics("svc", SPECS, process=False)

    def work() -> None:
        for _ in range(1000):
            metrics.observe("t_latency_seconds", 0.01)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert metrics.histogram_count("t_latency_seconds") == 4000


def test_quantiles_from_buckets() -> None:
    metrics = Metrics("svc", SPECS, process=False)
    before = metrics.histogram_buckets("t_latency_seconds")
    assert math.isnan(quantile_from_buckets(before, 0.5))
    for v in [0.02] * 90 + [2.0] * 10:
        metrics.observe("t_latency_seconds", v)
    now = metrics.histogram_buckets("t_latency_seconds")
    delta = bucket_delta(now, before)
    assert 0.01 < quantile_from_buckets(delta, 0.5) <= 0.025
    assert 1.0 < quantile_from_buckets(delta, 0.95) <= 2.5
    metrics.observe("t_latency_seconds", 1000.0)  # past the last bound: the last finite bound
    assert quantile_from_buckets(metrics.histogram_buckets("t_latency_seconds"), 1.0) == 60.0
    assert bucket_delta(now, now)[-1] == (math.inf, 0.0)

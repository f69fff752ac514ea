"""GET /metrics: Prometheus' text format, read back with prometheus-client's own parser.

The counts are checked exactly against /stats and the run file once a replay has
finished; scrapes taken while it runs must parse and only ever grow.
"""

import asyncio
import math
import threading
from collections import Counter

import numpy as np
import pandas as pd
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
parser = pytest.importorskip("prometheus_client.parser")

from live.loadgen import ReplayConfig, replay  # noqa: E402
from live.procs import serving  # noqa: E402
from live.serve_options import ServeOptions  # noqa: E402
from live.timings import Histogram  # noqa: E402
from qsim import from_arrays, make_trace, records  # noqa: E402

COUNTERS = ("qlab_requests_total", "qlab_requests_submitted_total", "qlab_upstream_errors_total")
GAUGES = (
    "qlab_requests_waiting",
    "qlab_requests_in_service",
    "qlab_engines",
    "qlab_engines_stalled",
    "qlab_queued_work_seconds",
    "qlab_speed_factor",
)
HISTOGRAMS = ("qlab_engine_time_seconds", "qlab_queue_time_seconds", "qlab_time_to_refusal_seconds")


def parse(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value}, after checking each family's type and help."""
    samples = {}
    types = {}
    for family in parser.text_string_to_metric_families(text):
        assert family.documentation, family.name
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    expected = {
        **{n.removesuffix("_total"): "counter" for n in COUNTERS},
        **dict.fromkeys(GAUGES, "gauge"),
        **dict.fromkeys(HISTOGRAMS, "histogram"),
    }
    assert types == expected
    return samples


def scrape(client, url: str) -> dict[tuple, float]:
    r = client.get(f"{url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=")
    return parse(r.text)


def requests_by(samples: dict) -> dict[tuple[str, str], float]:
    """qlab_requests_total as {(outcome, reason): count}."""
    return {
        (dict(labels)["outcome"], dict(labels)["reason"]): v
        for (name, labels), v in samples.items()
        if name == "qlab_requests_total"
    }


def histogram_count(samples: dict, name: str) -> float:
    return samples[(f"{name}_count", ())]


def assert_histograms_consistent(samples: dict) -> None:
    for name in HISTOGRAMS:
        buckets = sorted(
            (float(dict(labels)["le"]), v)
            for (n, labels), v in samples.items()
            if n == f"{name}_bucket"
        )
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1][0] == math.inf, name
        assert buckets[-1][1] == histogram_count(samples, name)


def assert_grew(before: dict, after: dict) -> None:
    """Counters and histograms never go down between two scrapes."""
    for key, value in before.items():
        name = key[0]
        if name.endswith(("_total", "_bucket", "_count", "_sum")):
            assert after[key] >= value, (key, value, after[key])


def test_histogram_buckets_are_inclusive_upper_bounds():
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 7.0):
        h.observe(value)
    assert h.cumulative() == [(0.1, 2), (1.0, 4), (math.inf, 5)]
    assert h.count == 5 and h.sum == pytest.approx(8.65)
    with pytest.raises(ValueError):
        Histogram((1.0, 0.5))


def _in_process_metrics(direct: bool) -> tuple[dict, dict]:
    """A fresh in-process app (own registry): some answers, an engine failure, refusals; then
    (metrics, stats)."""
    from live.engine import Faults, SyntheticEngine
    from live.gate import Gate, gate_config
    from live.http_api import create_app
    from qsim import preset

    engine = SyntheticEngine(speed=1e-4, faults=Faults(fail_every=3))  # runs 3, 6, ... raise
    app = create_app(
        Gate([engine], gate_config(preset("predictive"), fixed_estimate=True)), direct=direct
    )
    ok = {"prompt": "hello", "max_new_tokens": 4}
    bodies = [ok, ok, ok, {**ok, "deadline_ms": 1}, ok, {**ok, "deadline_ms": 1}]

    async def go():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://qlab.test"
            ) as client:
                # every series, at 0, from the start
                assert requests_by(parse((await client.get("/metrics")).text))
                statuses = [(await client.post("/v1/generate", json=b)).status_code for b in bodies]
                # 400: never in time (deadline_too_short)
                assert statuses == [200, 200, 500, 400, 200, 400]
                return parse((await client.get("/metrics")).text), (
                    await client.get("/stats")
                ).json()

    return asyncio.run(go())


def test_both_paths_count_the_same_and_apps_do_not_share_a_registry():
    """Requests on the direct path (past FastAPI's routing) are counted and timed as routed ones
    are."""
    direct, stats = _in_process_metrics(True)
    routed, _ = _in_process_metrics(False)  # a second app in the same process: its own registry
    by = requests_by(direct)
    assert by == requests_by(routed)
    assert by[("good", "")] + by[("late", "")] == 3 and by[("error", "engine_exception")] == 1
    assert by[("rejected", "deadline_too_short")] == 2 and sum(by.values()) == 6
    for samples in (direct, routed):
        assert histogram_count(samples, "qlab_time_to_refusal_seconds") == 2
        assert histogram_count(samples, "qlab_engine_time_seconds") == 4  # the failed run too
        assert histogram_count(samples, "qlab_queue_time_seconds") == 4
        assert samples[("qlab_requests_submitted_total", ())] == stats["submitted"] == 6
        assert samples[("qlab_upstream_errors_total", ())] == 0
        assert_histograms_consistent(samples)


def _trace():
    """Poisson arrivals and a burst of 12 at once: answers, refusals past the bound, perhaps
    expiries."""
    base = make_trace("poisson", load=1.5, seconds=2.0, seed=5)
    arrival = np.concatenate([base.arrival_s, np.full(12, 1.0)])
    tokens = np.concatenate([base.max_new_tokens, np.resize([4, 16, 64], 12)])
    order = np.argsort(arrival, kind="stable")
    return from_arrays(arrival[order], tokens[order], name="poisson+burst")


@pytest.mark.slow
def test_metrics_scraped_during_a_replay_agree_with_stats_and_the_run_file(tmp_path):
    options = ServeOptions(
        policy="bounded-deadline", max_queue=4, deadline=0.5, fail_every=4, speed=0.5
    )
    trace = _trace()
    with serving([options], tmp_path / "logs", 60) as (server,), httpx.Client(timeout=10) as client:
        result = {}
        runner = threading.Thread(
            target=lambda: result.update(frame=replay(trace, ReplayConfig(server.url)))
        )
        runner.start()
        scrapes = [scrape(client, server.url)]
        while runner.is_alive():  # however many fit in the replay: each must parse and only grow
            runner.join(0.05)
            scrapes.append(scrape(client, server.url))
        final = scrape(client, server.url)  # the replay has every answer: the server is at rest
        stats = client.get(f"{server.url}/stats").json()
    out = tmp_path / "run.parquet"
    result["frame"].to_parquet(out, index=False)
    rows = records.validate(pd.read_parquet(out))

    for before, after in zip([*scrapes, final], [*scrapes[1:], final]):
        assert_grew(before, after)
    for samples in (*scrapes, final):
        assert_histograms_consistent(samples)
        assert sum(requests_by(samples).values()) <= samples[("qlab_requests_submitted_total", ())]

    by = requests_by(final)
    # Against /stats: every outcome, every refusal reason, cancelled and submitted.
    for outcome, n in stats["counts"].items():
        assert sum(v for (o, _), v in by.items() if o == outcome) == n, outcome
    assert {r: by[("rejected", r)] for r in stats["rejected_by_reason"]} == stats[
        "rejected_by_reason"
    ]
    assert by[("cancelled", "")] == stats["cancelled"] == 0
    assert (
        final[("qlab_requests_submitted_total", ())]
        == stats["submitted"]
        == sum(by.values())
        == len(trace)
    )

    # Against the run file: each request once; good and late are judged on each side's own clock, so
    # only their sum.
    unanswered = rows[~rows["outcome"].isin(["good", "late"])]
    from_rows = Counter(zip(unanswered["outcome"], unanswered["reason"]))
    assert {k: v for k, v in by.items() if k[0] not in ("good", "late") and v} == dict(from_rows)
    assert by[("good", "")] + by[("late", "")] == rows["outcome"].isin(["good", "late"]).sum()
    assert (
        from_rows[("rejected", "queue_full")] > 0 and from_rows[("error", "engine_exception")] > 0
    )

    # The histograms: one refusal time per refusal, one engine and queue time per request an engine
    # ran.
    ran = by[("good", "")] + by[("late", "")] + by[("error", "engine_exception")]
    assert histogram_count(final, "qlab_time_to_refusal_seconds") == stats["counts"]["rejected"]
    assert histogram_count(final, "qlab_engine_time_seconds") == ran
    assert histogram_count(final, "qlab_queue_time_seconds") == ran
    assert final[("qlab_requests_waiting", ())] == final[("qlab_requests_in_service", ())] == 0
    assert final[("qlab_engines", ())] == 1 and final[("qlab_upstream_errors_total", ())] == 0

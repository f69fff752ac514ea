import math

import numpy as np
import pandas as pd
import pytest

from qsim.service import ServiceModel
from qsim.tracefiles import load_trace
from qsim.arrivals import arrivals_take_load, parse_arrivals
from qsim.mixes import REFERENCE_MIX, Mix
from qsim.workload import make_trace


def test_reference_mix_moments_match_the_reference_study():
    m = ServiceModel()
    assert REFERENCE_MIX.mean_s(m) == pytest.approx(0.146, rel=0.02)
    assert REFERENCE_MIX.capacity(m) == pytest.approx(6.86, rel=0.02)
    assert REFERENCE_MIX.scv(m) == pytest.approx(1.41, rel=0.03)
    assert REFERENCE_MIX.capacity(m, engines=4) == pytest.approx(4 * REFERENCE_MIX.capacity(m))


def test_mix_moments_are_exact():
    mix = Mix((1, 3), (0.25, 0.75))
    m = ServiceModel(0.0, 1.0)
    assert mix.mean_s(m) == pytest.approx(2.5)
    assert mix.second_moment_s(m) == pytest.approx(0.25 + 6.75)
    assert mix.scv(m) == pytest.approx(7.0 / 6.25 - 1)


@pytest.mark.parametrize(
    "sizes,probs",
    [
        ((4, 16), (0.5,)),
        ((16, 4), (0.5, 0.5)),
        ((4, 16), (0.6, 0.6)),
        ((0, 4), (0.5, 0.5)),
        ((), ()),
    ],
)
def test_bad_mix(sizes, probs):
    with pytest.raises(ValueError):
        Mix(sizes, probs)


def test_size_class_labels():
    labels = REFERENCE_MIX.size_class([1, 4, 5, 16, 64, 65, 900])
    assert list(labels) == ["4", "4", "16", "16", "64", ">64", ">64"]


def test_same_seed_same_trace_and_independent_streams():
    a = make_trace(load=1.3, seconds=100, seed=7)
    b = make_trace(load=1.3, seconds=100, seed=7)
    for field in ("arrival_s", "max_new_tokens", "true_service_s", "est_service_s"):
        assert np.array_equal(getattr(a, field), getattr(b, field))
    c = make_trace(load=1.3, seconds=100, seed=8)
    assert not np.array_equal(a.arrival_s[:50], c.arrival_s[:50])


def test_common_random_numbers_across_loads():
    # The same seed at another load: the same requests, gaps scaled by the rate.
    lo = make_trace(load=0.5, requests=500, seed=3)
    hi = make_trace(load=2.0, requests=500, seed=3)
    assert np.array_equal(lo.max_new_tokens, hi.max_new_tokens)
    assert np.allclose(lo.arrival_s, 4 * hi.arrival_s)
    # and a window is a prefix of a longer one
    short, long = (
        make_trace(load=1.0, seconds=50, seed=3),
        make_trace(load=1.0, seconds=200, seed=3),
    )
    assert np.array_equal(short.arrival_s, long.arrival_s[: len(short)])
    assert np.array_equal(short.true_service_s, long.true_service_s[: len(short)])


def test_poisson_rate_and_mix_shares():
    t = make_trace("poisson", load=1.0, seconds=20_000, seed=1)
    rate = REFERENCE_MIX.capacity(ServiceModel())
    n = len(t)
    assert abs(n - rate * 20_000) < 4 * np.sqrt(rate * 20_000)
    share = pd.Series(t.max_new_tokens).value_counts(normalize=True)
    for size, p in zip(REFERENCE_MIX.sizes, REFERENCE_MIX.probs):
        assert abs(share[size] - p) < 4 * np.sqrt(p * (1 - p) / n)
    assert t.duration_s == 20_000 and t.arrival_s.max() < 20_000


def test_gamma_cv_and_constant():
    t = make_trace(
        "gamma:2.0", "exponential", load=0.5, requests=40_000, seed=2, mean_service_s=1.0
    )
    gaps = np.diff(t.arrival_s)
    assert gaps.mean() == pytest.approx(2.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.08)
    c = make_trace("constant", "deterministic", load=0.5, requests=10, mean_service_s=1.0)
    assert np.allclose(np.diff(c.arrival_s), 2.0) and np.allclose(c.true_service_s, 1.0)


def test_speed_and_noise():
    base = make_trace(load=0.9, requests=20_000, seed=4)
    slow = make_trace(load=0.9, requests=20_000, seed=4, speed=2.25)
    assert np.allclose(slow.true_service_s, 2.25 * base.true_service_s)
    assert np.array_equal(slow.est_service_s, base.est_service_s)  # the calibration does not know
    # load is at the simulated speed
    assert slow.arrival_s[-1] == pytest.approx(2.25 * base.arrival_s[-1])
    noisy = make_trace(load=0.9, requests=20_000, seed=4, noise_cv=0.3)
    ratio = noisy.true_service_s / noisy.est_service_s
    assert ratio.mean() == pytest.approx(1.0, abs=0.01)
    assert ratio.std() == pytest.approx(0.3, rel=0.05)


def test_exponential_service():
    t = make_trace(
        "poisson", "exponential", load=0.9, engines=2, requests=50_000, seed=5, mean_service_s=0.5
    )
    assert t.true_service_s.mean() == pytest.approx(0.5, rel=0.02)
    assert np.all(t.est_service_s == 0.5)
    assert len(t) / t.arrival_s[-1] == pytest.approx(0.9 * 2 / 0.5, rel=0.02)


def test_bursts():
    b = make_trace("burst:30", seconds=1)
    assert len(b) == 30 and np.all(b.arrival_s == 0) and b.duration_s == 0
    p = make_trace("periodic:5:2.0", seconds=10)
    assert len(p) == 25 and list(np.unique(p.arrival_s)) == [0, 2, 4, 6, 8]


@pytest.mark.parametrize("load", [0.05, 0.5, 0.9, 2.0, 3.7])
def test_periodic_bursts_at_a_load_have_its_rate_and_the_poisson_traces_requests(load):
    # A burst every 10 s whose size follows the load: the rate is exact over whole periods, the
    # bursts differ by at most one request, and the requests are the Poisson trace's (common random
    # numbers: the same sizes).
    p = make_trace("periodic:10", load=load, seconds=600, seed=3)
    poisson = make_trace("poisson", load=load, requests=len(p), seed=3)
    rate = load / REFERENCE_MIX.mean_s(ServiceModel())
    assert p.meta["rate"] == pytest.approx(rate) and p.duration_s == 600
    assert len(p) == math.ceil(600 * rate - 1e-9)
    times, sizes = np.unique(p.arrival_s, return_counts=True)
    assert set(times) <= set(np.arange(0, 600, 10.0)) and np.all(np.diff(p.arrival_s) >= 0)
    full = sizes[:-1]  # the last burst may be the part of its period inside the window
    assert full.max() - full.min() <= 1 and full.mean() == pytest.approx(rate * 10, abs=1)
    np.testing.assert_array_equal(p.max_new_tokens, poisson.max_new_tokens)
    # requests= takes the first N of the same bursts.
    np.testing.assert_array_equal(
        make_trace("periodic:10", load=load, requests=50, seed=3).arrival_s,
        make_trace("periodic:10", load=load, seconds=600, seed=3).arrival_s[:50],
    )


@pytest.mark.parametrize("spec", ["burst:30", "periodic:20:10"])
def test_a_process_of_its_own_size_takes_no_load(spec):
    with pytest.raises(ValueError, match=f"arrivals '{spec}' take no load"):
        make_trace(spec, load=2.0, seconds=60)
    assert arrivals_take_load("periodic:10") and not arrivals_take_load(spec)
    # Without one it is what it was: its size sets its rate.
    assert len(make_trace(spec, seconds=60)) == (30 if spec == "burst:30" else 120)


@pytest.mark.parametrize(
    "spec",
    [
        "pareto",
        "gamma",
        "gamma:x",
        "burst:0",
        "burst:2.5",
        "periodic:1:2:3",
        "periodic:0",
        "periodic:2.5:10",
        "periodic",
        "gamma:-1",
    ],
)
def test_bad_arrival_specs(spec):
    with pytest.raises(ValueError, match="arrival process"):
        parse_arrivals(spec)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(seconds=1, requests=1),
        dict(seconds=-1),
        dict(requests=0),
        dict(seconds=1, load=0),
        dict(seconds=1, speed=0),
        dict(seconds=1, engines=0),
        dict(seconds=1, service="uniform"),
        dict(seconds=1, mean_service_s=1.0),
    ],
)
def test_bad_trace_arguments(kwargs):
    with pytest.raises(ValueError):
        make_trace(**kwargs)


def test_load_azure_trace(azure_csv):
    t = load_trace(azure_csv)
    assert len(t) == 8819
    assert t.arrival_s[0] == 0 and np.all(np.diff(t.arrival_s) >= 0)
    assert t.duration_s == pytest.approx(3435.95, abs=0.01)
    assert t.max_new_tokens[:3].tolist() == [10, 8, 27]
    assert t.prompt_tokens[:3].tolist() == [4808, 3180, 110]
    assert np.allclose(t.true_service_s, ServiceModel().estimate(t.max_new_tokens))
    half = load_trace(azure_csv, time_scale=0.5)
    assert np.allclose(half.arrival_s, 0.5 * t.arrival_s)


def test_zoned_timestamps_are_put_on_utc(tmp_path):
    path = tmp_path / "zoned.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16T18:17:04+05:00,10,5\n"
        "2023-11-16T13:17:05.5Z,3,4\n2023-11-16T14:17:06+01:00,3,4\n"
    )
    assert load_trace(path).arrival_s.tolist() == [0.0, 1.5, 2.0]


def test_own_trace_round_trip(tmp_path):
    t = make_trace(load=1.2, seconds=30, seed=9, noise_cv=0.2)
    for name in ("t.csv", "t.parquet"):
        t.save(tmp_path / name)
        back = load_trace(tmp_path / name)
        assert np.allclose(back.arrival_s, t.arrival_s)
        assert np.array_equal(back.max_new_tokens, t.max_new_tokens)
        assert np.allclose(back.true_service_s, t.true_service_s)
        assert np.all(np.isnan(back.deadline_s))


def test_own_trace_minimal_with_deadlines(tmp_path):
    path = tmp_path / "mini.csv"
    path.write_text("arrival_s,max_new_tokens,deadline_s\n0.5,16,\n0.0,4,1.5\n")
    t = load_trace(path, speed=2.0)
    assert t.arrival_s.tolist() == [0.0, 0.5]  # sorted
    assert t.max_new_tokens.tolist() == [4, 16]
    assert t.deadline_s[0] == 1.5 and np.isnan(t.deadline_s[1])
    assert np.allclose(t.true_service_s, 2.0 * ServiceModel().estimate([4, 16]))


@pytest.mark.parametrize(
    "text,message",
    [
        ("arrival_s,max_new_tokens\n0.1,4\n0.2,four\n", "line 3: bad max_new_tokens 'four'"),
        ("arrival_s,max_new_tokens\n0.1,4\n0.2,0\n", "line 3: bad max_new_tokens"),
        ("arrival_s,max_new_tokens\n0.1,4\n0.2,4.5\n", "line 3: bad max_new_tokens"),
        ("arrival_s,max_new_tokens\n-1,4\n", "line 2: bad arrival_s"),
        ("arrival_s,max_new_tokens\n0.1,4\n0.2,4,9\n", "line 3"),
        ("arrival_s,max_new_tokens,deadline_s\n0.1,4,soon\n", "line 2: bad deadline_s 'soon'"),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,10,5\nyesterday,3,4\n",
            "line 3: bad TIMESTAMP 'yesterday'",
        ),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,10,-5\n",
            "line 2: bad GeneratedTokens",
        ),
        # Local times and zoned times cannot share one axis (found by tests/test_fuzz.py exploring).
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 "
            "18:17:03.97,10,5\n2023-11-16T18:17:04+05:00,3,4\n",
            "line 3: bad TIMESTAMP '2023-11-16T18:17:04+05:00': a UTC offset, unlike line 2",
        ),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16T18:17:04Z,10,5\n2023-11-16 "
            "18:17:05,3,4\n",
            "line 3: bad TIMESTAMP '2023-11-16 18:17:05': no UTC offset, unlike line 2",
        ),
        ("when,what\n1,2\n", "unrecognised trace columns"),
        ("arrival_s,max_new_tokens\n", "no requests"),
        ("", "empty"),
    ],
)
def test_malformed_trace_names_the_line(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_trace(path)
    assert message in str(err.value) and "bad.csv" in str(err.value)


def test_missing_and_binary_files(tmp_path):
    with pytest.raises(ValueError, match="no such trace file"):
        load_trace(tmp_path / "nope.csv")
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"\x00\x01not parquet")
    with pytest.raises(ValueError, match="cannot read parquet"):
        load_trace(junk)
    with pytest.raises(ValueError, match="time scale"):
        load_trace(junk, time_scale=0)


def _same_trace(a, b) -> None:
    pd.testing.assert_frame_equal(a.to_frame(), b.to_frame())
    assert (a.duration_s, a.name, a.meta) == (b.duration_s, b.name, b.meta)


def test_build_trace_gives_what_each_command_built_before(tmp_path):
    """build_trace against the calls each command made before it existed (same seed, same trace)."""
    from qsim import build_trace

    model = ServiceModel(0.002, 0.009)
    own = tmp_path / "own.csv"
    make_trace(requests=50, seed=4).save(own)
    # qlab simulate: every option, synthetic or a trace file with speed and noise.
    _same_trace(
        build_trace(
            arrivals="gamma:2",
            service="mix",
            load=1.3,
            engines=2,
            speed=1.5,
            requests=300,
            seed=7,
            model=model,
            noise_cv=0.3,
        ),
        make_trace(
            "gamma:2",
            "mix",
            load=1.3,
            engines=2,
            speed=1.5,
            seconds=None,
            requests=300,
            seed=7,
            model=model,
            mean_service_s=None,
            noise_cv=0.3,
        ),
    )
    _same_trace(
        build_trace(service="exponential", mean_service_s=0.2, seconds=60.0, seed=1),
        make_trace("poisson", "exponential", load=0.9, seconds=60.0, seed=1, mean_service_s=0.2),
    )
    _same_trace(
        build_trace(own, time_scale=0.5, speed=2.0, noise_cv=0.2, seed=3, model=model),
        load_trace(own, 0.5, model=model, speed=2.0, noise_cv=0.2, seed=3),
    )
    # qlab replay and qlab live: a default window of 40 s; a burst's length is its size.
    _same_trace(
        build_trace(
            arrivals="poisson", load=1.2, engines=2, default_seconds=40.0, seed=2, model=model
        ),
        make_trace("poisson", load=1.2, engines=2, seed=2, model=model, seconds=40.0),
    )
    _same_trace(
        build_trace(arrivals="burst:12", default_seconds=40.0, seed=1),
        make_trace("burst:12", seed=1, requests=12),
    )
    _same_trace(
        build_trace(arrivals="constant", load=0.5, requests=40, default_seconds=40.0, seed=4),
        make_trace("constant", load=0.5, requests=40, seed=4),
    )
    _same_trace(
        build_trace(own, time_scale=2.0, seed=9, model=model),
        load_trace(own, 2.0, model=model, seed=9),
    )
    # a sweep cell: a mix of its own, speed and noise.
    mix = Mix((8, 32), (0.7, 0.3))
    _same_trace(
        build_trace(
            arrivals="periodic:2",
            load=0.8,
            engines=2,
            speed=2.25,
            seconds=30.0,
            seed=5,
            mix=mix,
            model=model,
            noise_cv=0.1,
        ),
        make_trace(
            "periodic:2",
            "mix",
            load=0.8,
            engines=2,
            speed=2.25,
            seconds=30.0,
            seed=5,
            mix=mix,
            model=model,
            noise_cv=0.1,
        ),
    )

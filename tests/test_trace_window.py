"""A window of a trace file (``--start``, ``--seconds``) and its rate (``--load`` /
``--nominal-load``): qsim.tracefiles.TraceWindow, which ``qlab simulate`` and ``qlab replay`` share
(experiments.simflags)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from experiments.cli import main
from qsim import PRESETS, ServiceModel, build_trace, load_trace, simulate
from qsim.tracefiles import TraceWindow, build_chunks

#: Arrivals with requests exactly on the window's edges (2.0 and 5.0) and around them.
ARRIVALS = [0.5, 1.0, 1.999, 2.0, 2.5, 3.0, 4.999, 5.0, 5.5, 8.0, 9.25]


@pytest.fixture
def own_csv(tmp_path):
    """A qlab trace file: arrivals, sizes and a prompt length each, true times from the model."""
    path = tmp_path / "own.csv"
    n = len(ARRIVALS)
    pd.DataFrame(
        {
            "arrival_s": ARRIVALS,
            "max_new_tokens": [16 * (1 + i % 4) for i in range(n)],
            "prompt_tokens": [10 * i for i in range(n)],
        }
    ).to_csv(path, index=False)
    return path


def test_a_window_takes_exactly_the_arrivals_in_it_shifted_to_start_at_0(own_csv):
    whole = load_trace(own_csv)
    part = build_trace(own_csv, window=TraceWindow(start_s=2.0, seconds=3.0))
    inside = [i for i, t in enumerate(ARRIVALS) if 2.0 <= t < 5.0]
    assert inside == [3, 4, 5, 6]  # 2.0 in, 5.0 out: [start, start + seconds)
    np.testing.assert_array_equal(part.arrival_s, np.asarray(ARRIVALS)[inside] - 2.0)
    np.testing.assert_array_equal(part.max_new_tokens, whole.max_new_tokens[inside])
    np.testing.assert_array_equal(part.prompt_tokens, whole.prompt_tokens[inside])
    np.testing.assert_array_equal(part.true_service_s, whole.true_service_s[inside])
    assert part.duration_s == 3.0 and part.meta["window"]["time_factor"] == 1.0
    # From a start to the file's end: the last request closes the window.
    tail = build_trace(own_csv, window=TraceWindow(start_s=5.0))
    np.testing.assert_array_equal(tail.arrival_s, [0.0, 0.5, 3.0, 4.25])
    assert tail.duration_s == 4.25
    # A window past the file's end is as long as the file lets it be.
    assert build_trace(own_csv, window=TraceWindow(start_s=8.0, seconds=100.0)).duration_s == 1.25
    # Seconds alone: from the first request.
    first = build_trace(own_csv, window=TraceWindow(seconds=1.0))
    np.testing.assert_array_equal(first.arrival_s, [0.0, 0.5])


@pytest.mark.parametrize(
    "load, engines, window",
    [(0.7, 1, TraceWindow()), (2.0, 3, TraceWindow(1.0, 6.0)), (1.3, 2, TraceWindow(seconds=4.0))],
)
def test_a_load_scales_the_windows_mean_rate_to_that_load_of_its_engines(
    own_csv, load, engines, window
):
    window = TraceWindow(window.start_s, window.seconds, load)
    # No start: the window starts at the file's first request (0.5 s), as its length does.
    plain = build_trace(own_csv, window=TraceWindow(window.start_s or ARRIVALS[0], window.seconds))
    scaled = build_trace(own_csv, window=window, engines=engines)
    rate = len(scaled) / scaled.duration_s
    assert rate == pytest.approx(load * engines / scaled.true_service_s.mean(), rel=1e-12)
    # One factor on every time: the gaps keep their shape, the requests their sizes.
    factor = scaled.meta["window"]["time_factor"]
    np.testing.assert_allclose(scaled.arrival_s, plain.arrival_s * factor, rtol=1e-12)
    np.testing.assert_array_equal(scaled.max_new_tokens, plain.max_new_tokens)
    np.testing.assert_array_equal(scaled.true_service_s, plain.true_service_s)


def test_a_load_counts_the_simulated_speed_as_synthetic_arrivals_do(own_csv):
    # Load is utilisation at the simulated speed: twice as slow a machine gets half the rate.
    fast = build_trace(own_csv, window=TraceWindow(load=1.0))
    slow = build_trace(own_csv, window=TraceWindow(load=1.0), speed=2.0)
    assert slow.duration_s == pytest.approx(2 * fast.duration_s, rel=1e-12)


def test_without_a_window_a_trace_file_gives_the_same_rows(own_csv):
    model = ServiceModel(0.002, 0.01, 1e-4)
    # load, seconds: synthetic's
    options = dict(model=model, noise_cv=0.3, seed=4, engines=2, load=3.0, seconds=1.0)
    before = build_trace(own_csv, **options)
    for window in (None, TraceWindow()):
        after = build_trace(own_csv, window=window, **options)
        pd.testing.assert_frame_equal(after.to_frame(), before.to_frame())
        assert after.duration_s == before.duration_s
    pd.testing.assert_frame_equal(
        simulate(build_trace(own_csv, window=TraceWindow()), PRESETS["predictive"]),
        simulate(load_trace(own_csv), PRESETS["predictive"]),
    )


def test_streamed_chunks_take_the_same_window(own_csv):
    window = TraceWindow(1.0, 5.0, 1.7)
    whole = build_trace(own_csv, window=window, engines=2)
    chunks = build_chunks(2, own_csv, window=window, engines=2)
    assert chunks.duration_s == whole.duration_s
    np.testing.assert_array_equal(np.concatenate([c.arrival_s for c in chunks]), whole.arrival_s)


def test_what_a_window_cannot_be(own_csv):
    with pytest.raises(
        ValueError,
        match=r"no request arrives in \[20, 25\) s \(its arrivals run "
        r"from 0.5 to 9.25 s\)",
    ):
        build_trace(own_csv, window=TraceWindow(20.0, 5.0))
    with pytest.raises(ValueError, match="no length to take a rate over"):
        build_trace(own_csv, window=TraceWindow(9.25, load=1.0))  # the last request alone: no span
    with pytest.raises(ValueError, match="applies to a trace file"):
        build_trace(None, window=TraceWindow(seconds=3.0), seconds=3.0)
    for bad in (dict(start_s=-1.0), dict(seconds=0.0), dict(load=float("inf"))):
        with pytest.raises(ValueError, match="a trace window's"):
            TraceWindow(**bad)


def test_simulate_takes_a_window_of_a_trace_file(own_csv, capsys):
    assert (
        main(
            [
                "simulate",
                "--trace",
                str(own_csv),
                "--start",
                "2",
                "--seconds",
                "3",
                "--load",
                "0.8",
                "--policy",
                "predictive",
                "--json",
            ]
        )
        == 0
    )
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["requests"] == 4
    assert (
        main(
            [
                "simulate",
                "--trace",
                str(own_csv),
                "--start",
                "2",
                "--seconds",
                "3",
                "--load",
                "0.8",
                "--policy",
                "predictive",
            ]
        )
        == 0
    )
    assert f"trace {own_csv} (3 s from 2 s, scaled to load 0.8)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["simulate", "--start", "5"], "--start applies only with --trace"),
        (
            ["simulate", "--trace", "TRACE", "--requests", "10"],
            "--requests applies to synthetic arrivals",
        ),
        (
            ["simulate", "--trace", "TRACE", "--load", "2", "--time-scale", "0.5"],
            "--load and --time-scale both set the trace's rate",
        ),
        (
            ["simulate", "--trace", "TRACE", "--start", "100", "--seconds", "5"],
            "no request arrives in [100, 105) s",
        ),
        (
            ["simulate", "--trace", "TRACE", "--load", "2", "--batching"],
            "--load with --trace and --batching",
        ),
        # qlab replay refuses before it asks the server anything (nothing listens on port 9).
        (
            ["replay", "--url", "http://127.0.0.1:9", "--start", "3", "--out", "OUT"],
            "--start applies only with --trace",
        ),
        (
            [
                "replay",
                "--url",
                "http://127.0.0.1:9",
                "--trace",
                "TRACE",
                "--requests",
                "3",
                "--out",
                "OUT",
            ],
            "--requests applies to synthetic arrivals",
        ),
        (
            [
                "replay",
                "--url",
                "http://127.0.0.1:9",
                "--trace",
                "TRACE",
                "--nominal-load",
                "2",
                "--time-scale",
                "2",
                "--out",
                "OUT",
            ],
            "--nominal-load and --time-scale both set the trace's rate",
        ),
    ],
)
def test_what_a_trace_file_cannot_take_is_one_line_and_exit_2(
    own_csv, tmp_path, capsys, argv, message
):
    argv = [
        str(own_csv) if a == "TRACE" else str(tmp_path / "run.parquet") if a == "OUT" else a
        for a in argv
    ]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert (
        message in captured.err
        and captured.err.count("\n") == 1
        and "Traceback" not in captured.err
    )
    assert not (tmp_path / "run.parquet").exists()

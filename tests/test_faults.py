"""Faults, each injected by the test: a failing engine, a hung or very slow engine, clients that
hang up, a server killed under `qlab replay`, and `qlab sweep` / `qlab live` interrupted by SIGINT
or SIGKILL.

Every request must end in exactly one recorded outcome (the gate's counts, the client's rows),
nothing may wait forever, and whatever was written to disk must be whole and resumable.

In-process gates use a service line of 2 ms + 4 ms/token (12 tokens: 0.05 s) and a stall floor of
0.2 s; servers are real `qlab serve` subprocesses with the synthetic engine on the reference line (4
tokens: 35 ms).
"""

import asyncio
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from experiments import config, sweep  # noqa: E402
from experiments import live_runner as runner  # noqa: E402
from live import live_config  # noqa: E402
from live.engine import NO_ABILITIES, Faults, InjectedFault, SyntheticEngine  # noqa: E402
from live.gate import Gate, gate_config  # noqa: E402
from live.gate_errors import DeadlineExceeded, EngineStalled, Rejected  # noqa: E402
from live.jobs import Job  # noqa: E402
from experiments.cli import main  # noqa: E402
from live.loadgen import ReplayConfig, replay  # noqa: E402
from live.procs import Server, serving  # noqa: E402
from live.serve_options import ServeOptions  # noqa: E402
from qsim import PRESETS, ServiceModel, from_arrays, records  # noqa: E402
from qsim.config import ServerConfig, StallRule  # noqa: E402
from virtual_time import LoopSynthetic, on_virtual_clock  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = ServiceModel(intercept_s=0.002, per_token_s=0.004)
GENERATE = "/v1/generate"


def settled(stats: dict) -> bool:
    """At rest every request decided on has exactly one outcome (abandoned: its client left)."""
    return (
        stats["waiting"] == 0
        and stats["in_service"] == 0
        and stats["submitted"] == sum(stats["counts"].values())
        and stats["cancelled"] == stats["counts"]["abandoned"]
    )


# ---------------------------------------------------------------- in-process: a hung or slow
# engine, on a virtual clock The gate runs these engines as tasks on a loop whose clock jumps to its
# next timer (tests/virtual_time.py): each time below is exact, to the watchdog's interval, however
# busy the machine.

# how often the watchdog looks: the precision the gate promises for a stall or an expiry
WATCH_S = 0.01


def _stall_config(policy, stall_factor: float = 2.0) -> ServerConfig:
    """Stalled past max(2 x estimate, 0.2 s): 0.2 s for a 0.05 s request."""
    return gate_config(
        policy, model=MODEL, stall=StallRule(stall_factor, 0.2), watch_interval_s=WATCH_S
    )


def _by_the_watchdog(at: float, due: float) -> bool:
    """Whether the watchdog acted on ``due`` at ``at``: its first look at or past it (within
    float sums)."""
    return due - 1e-9 <= at <= due + WATCH_S + 1e-9


async def _until(predicate) -> None:
    """Wait on the virtual clock (instantly) until ``predicate()``; 60 virtual seconds is far
    past anything here."""
    end = asyncio.get_running_loop().time() + 60
    while not predicate():
        assert asyncio.get_running_loop().time() < end, "timed out waiting"
        await asyncio.sleep(WATCH_S)


async def _timed(future):
    """(outcome or exception, the loop's time when it ended)."""
    try:
        result = await future
    except Exception as exc:
        result = exc
    return result, asyncio.get_running_loop().time()


@pytest.mark.parametrize(
    "policy, behind",
    [
        ("none", EngineStalled),
        ("bounded-deadline", DeadlineExceeded),
        ("predictive", DeadlineExceeded),
    ],
)
def test_a_hung_engine_ends_its_request_and_those_behind_it(policy, behind):
    """The engine hangs 1 s: its request ends at the 0.2 s threshold, the waiting ones at their
    deadlines."""
    engine = LoopSynthetic(MODEL, faults=Faults(hang_after=0, hang_s=1.0))

    async def go():
        loop = asyncio.get_running_loop()
        async with Gate([engine], _stall_config(PRESETS[policy]), clock=loop.time) as gate:
            hung = asyncio.ensure_future(_timed(gate.submit(Job("a", 12))))
            waiting = [
                asyncio.ensure_future(_timed(gate.submit(Job(p, 12, deadline_s=d))))
                for p, d in (("b", 0.4), ("c", 0.6))
            ]
            stalled, stalled_at = await hung
            during = gate.health(), gate.stats()
            ends = [await w for w in waiting]
            await _until(lambda: gate.in_service == 0)  # the engine returns at 1.05 s
            back_at = loop.time()
            factor_after_hang = gate.tracker.factor
            answer = await gate.submit(Job("d", 12))  # the engine works again
            return (
                stalled,
                stalled_at,
                during,
                ends,
                back_at,
                factor_after_hang,
                answer,
                gate.health(),
                gate.stats(),
            )

    stalled, stalled_at, (health, stats), ends, back_at, factor, answer, health_after, final = (
        on_virtual_clock(go)
    )
    assert isinstance(stalled, EngineStalled) and stalled.engine == 0
    assert (
        _by_the_watchdog(stalled_at, 0.2)
        and stalled_at > 0.2
        and stalled.numbers["stall_after_s"] == 0.2
    )
    assert health["status"] == "degraded" and health["stalled"][0]["engine"] == 0
    assert (
        health["stalled"][0]["running_s"] == stalled_at
        and stats["stalled"] == 1
        and stats["in_service"] == 1
    )
    for (exc, at), deadline in zip(ends, (0.4, 0.6)):
        assert isinstance(exc, behind), exc
        assert _by_the_watchdog(at, deadline)  # at its deadline, long before the engine came back
    assert _by_the_watchdog(back_at, 1.05)  # hung 1 s, then its 0.05 s run
    assert factor == 1.0  # the hung request taught the tracker nothing
    assert (
        answer.outcome == "good"
        and answer.queue_s == 0
        and health_after == {"status": "ok", "stalled": []}
    )
    expected = {"error": 3} if behind is EngineStalled else {"error": 1, "expired": 2}
    assert {k: v for k, v in final["counts"].items() if v} == {**expected, "good": 1}
    assert settled(final) and final["submitted"] == 4 and final["stalled"] == 0


def test_predictive_keeps_refusing_on_the_estimate_while_an_engine_is_stalled():
    """Past its threshold a stalled engine's remaining work is its overrun, not zero: no rush of
    admissions."""
    engine = LoopSynthetic(MODEL, faults=Faults(hang_after=0, hang_s=0.8))

    async def go():
        loop = asyncio.get_running_loop()
        async with Gate([engine], _stall_config(PRESETS["predictive"]), clock=loop.time) as gate:
            hung = gate.submit(Job("a", 12))
            with pytest.raises(EngineStalled):
                await hung
            # virtual: the estimate said 0.05 s; it has now run about 0.5 s
            await asyncio.sleep(0.3)
            with pytest.raises(Rejected) as refused:
                gate.submit(Job("b", 12, deadline_s=0.3))
            await _until(lambda: gate.in_service == 0)
            return refused.value

    refused = on_virtual_clock(go)
    rejection = refused.rejection
    # Counted as about to finish (qsim's rule below the threshold), the wait would be 0 and b
    # admitted.
    assert rejection.reason == "deadline_unreachable"
    # its overrun so far
    assert rejection.numbers["wait_s"] == pytest.approx(refused.arrival.at - 0.05)
    assert refused.arrival.at == pytest.approx(0.5, abs=WATCH_S) and rejection.retry_after_s == 1


def test_a_very_slow_engine_is_stalled_at_ten_times_its_estimate_and_teaches_nothing():
    engine = LoopSynthetic(MODEL, speed=30.0)  # 0.05 s estimated, 1.5 s taken: past 10 x 0.05 s

    async def go():
        loop = asyncio.get_running_loop()
        async with Gate(
            [engine], _stall_config(PRESETS["none"], stall_factor=10.0), clock=loop.time
        ) as gate:
            exc, at = await _timed(gate.submit(Job("a", 12)))
            await _until(lambda: gate.in_service == 0)
            return exc, at, loop.time(), gate.tracker.factor, gate.stats()

    exc, at, back_at, factor, stats = on_virtual_clock(go)
    assert isinstance(exc, EngineStalled) and _by_the_watchdog(at, 0.5) and at > 0.5
    assert exc.numbers["stall_after_s"] == pytest.approx(0.5) and _by_the_watchdog(back_at, 1.5)
    assert factor == 1.0 and stats["counts"]["error"] == 1 and settled(stats)


class _Deaf(SyntheticEngine):
    """A synthetic engine whose run takes no cancel: it cannot be stopped, as an engine written
    before cancel."""

    abilities = NO_ABILITIES

    def run(self, prompt, max_new_tokens, stop=None):
        return super().run(prompt, max_new_tokens, stop)


def test_a_request_cancelled_while_running_holds_its_engine_until_the_run_ends():
    async def go():
        async with Gate([_Deaf(MODEL)], gate_config(PRESETS["none"], model=MODEL)) as gate:
            running = gate.submit(Job("a", 12))  # in service at once: an idle engine took it
            behind = gate.submit(Job("b", 4))
            running.cancel()  # its client hung up while the engine ran it
            await asyncio.sleep(0)
            during = gate.stats()
            answer = await behind
            return during, answer, gate.stats()

    during, answer, final = asyncio.run(go())
    assert during["cancelled"] == 1 and during["in_service"] == 1 and during["waiting"] == 1
    assert answer.queue_s >= 0.045  # b started when a's run ended, not when a's client left
    assert final["counts"]["good"] == 1 and settled(final)


def test_fault_schedule_of_the_synthetic_engine():
    faults = Faults(fail_every=3, hang_after=4, hang_s=0.01)
    assert [n for n in range(1, 10) if faults.fails(n)] == [3, 6, 9]
    assert [n for n in range(1, 10) if faults.hangs(n)] == [5]
    engine = SyntheticEngine(ServiceModel(0.0, 0.0001), faults=Faults(fail_every=2))
    engine.run("x", 1)
    with pytest.raises(InjectedFault, match="run 2"):
        engine.run("x", 1)
    assert engine.info()["faults"]["fail_every"] == 2
    for bad in ({"fail_every": -1}, {"hang_after": -1}, {"hang_after": 0, "hang_s": 0.0}):
        with pytest.raises(ValueError):
            Faults(**bad)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hang-for", "2"], "--hang-for: only with --hang-after"),
        (["--engine", "gpt2", "--fail-every", "3"], "--fail-every: only with --engine synthetic"),
        (["--fail-every", "0"], "must be > 0"),
        (["--stall-factor", "0.5"], "must be >= 1"),
        (["--stall-after", "0"], "must be > 0"),
    ],
)
def test_fault_and_stall_flags_are_checked(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


# ---------------------------------------------------------------- through real servers


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Three servers started together: plain (none), failing every 3rd run (bounded), hanging on
    run 2 (predictive)."""
    options = [
        ServeOptions(policy="none"),
        ServeOptions(policy="bounded", fail_every=3),
        ServeOptions(policy="predictive", hang_after=1, hang_for=2.5, stall_after=0.5),
    ]
    with serving(options, tmp_path_factory.mktemp("logs"), 60) as running:
        yield {s.options.policy: s.url for s in running}


def stats(url: str) -> dict:
    return httpx.get(f"{url}/stats").json()


def error_of(response, status: int, type_: str, reason: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"type", "reason", "code", "message", "numbers", "retry_after_s"}
    assert (error["type"], error["reason"]) == (type_, reason) and error["message"]
    return error


def delta(after: dict, before: dict) -> dict:
    """Outcome counts that changed between two /stats readings."""
    change = {k: after["counts"][k] - before["counts"][k] for k in after["counts"]}
    return {k: v for k, v in change.items() if v}


@pytest.mark.slow
def test_engine_failures_are_500s_recorded_as_errors_and_the_next_request_is_served(servers):
    url = servers["bounded"]  # --fail-every 3: runs 3, 6, 9, ... raise at once
    before = stats(url)
    statuses, factors = [], []
    for _ in range(6):
        factor = stats(url)["speed_factor"]
        r = httpx.post(f"{url}{GENERATE}", json={"prompt": "x", "max_new_tokens": 4}, timeout=10)
        statuses.append(r.status_code)
        factors.append((factor, stats(url)["speed_factor"]))
        if r.status_code == 500:
            error = error_of(r, 500, "engine_error", "engine_exception")
            assert "injected failure" in error["message"] and error["numbers"]["engine"] == 0
            # When the engine took it and handed the failure back (gate clock): what a replay needs.
            assert (
                error["numbers"]["returned_at"]
                >= error["numbers"]["started_at"]
                >= error["numbers"]["arrived_at"]
            )
    assert statuses == [200, 200, 500, 200, 200, 500]
    # a failure teaches the tracker nothing
    assert factors[2][0] == factors[2][1] and factors[5][0] == factors[5][1]
    assert delta(stats(url), before) == {"good": 4, "error": 2}
    # The same through the replayer: runs 7..15, so 9, 12 and 15 fail; its rows and /stats agree.
    trace = from_arrays(np.arange(9) * 0.08, np.full(9, 4))
    before = stats(url)
    rows = replay(trace, ReplayConfig(url, timeout_s=10))
    after = stats(url)
    assert list(rows["outcome"]) == ["good", "good", "error"] * 3
    errors = rows[rows["outcome"] == "error"]
    assert (errors["http_status"] == 500).all() and errors["error"].str.contains(
        "engine_error"
    ).all()
    assert delta(after, before) == {"good": 6, "error": 3} and settled(after)


@pytest.mark.slow
def test_a_hung_engine_through_the_service(servers):
    """--hang-after 1 --hang-for 2.5 --stall-after 0.5: run 2 hangs 2.5 s; predictive policy."""
    url = servers["predictive"]

    async def go():
        async with httpx.AsyncClient(
            base_url=url, timeout=10, limits=httpx.Limits(max_connections=None)
        ) as client:

            def post(deadline_ms=None):
                body = {
                    "prompt": "x",
                    "max_new_tokens": 4,
                    **({"deadline_ms": deadline_ms} if deadline_ms else {}),
                }
                return client.post(GENERATE, json=body)

            first = await post()  # run 1
            before = (await client.get("/stats")).json()
            t0 = time.monotonic()
            hung = asyncio.ensure_future(post(10_000))  # run 2: hangs
            await asyncio.sleep(0.1)
            # admitted (the engine is not yet known to be stuck): waits
            behind = asyncio.ensure_future(post(1_200))
            hung_r = await hung
            hung_at = time.monotonic() - t0
            health = (await client.get("/healthz")).json()
            refused = await post(400)
            behind_r = await behind
            behind_at = time.monotonic() - t0
            while (await client.get("/healthz")).json()["status"] != "ok":
                assert time.monotonic() - t0 < 8, "the engine never came back"
                await asyncio.sleep(0.05)
            factor = (await client.get("/stats")).json()["speed_factor"]
            last = await post()
            return (
                first,
                before,
                hung_r,
                hung_at,
                health,
                refused,
                behind_r,
                behind_at,
                factor,
                last,
            )

    first, before, hung, hung_at, health, refused, behind, behind_at, factor, last = asyncio.run(
        go()
    )
    assert first.status_code == 200
    stalled = error_of(hung, 500, "engine_error", "engine_stalled")
    # Never before the threshold (when, exactly, is checked on the virtual clock above: a busy
    # machine may answer a real server's stall later).
    assert (
        hung_at >= 0.5
        and stalled["numbers"]["stall_after_s"] == 0.5
        and stalled["numbers"]["engine"] == 0
    )
    assert stalled["numbers"]["running_s"] >= 0.5
    assert health["status"] == "degraded" and [s["engine"] for s in health["stalled"]] == [0]
    # the overrun counts as work left
    refusal = error_of(refused, 503, "overloaded", "deadline_unreachable")
    assert refusal["numbers"]["wait_s"] >= 0.4 and int(refused.headers["Retry-After"]) >= 1
    error_of(behind, 503, "deadline_exceeded", "cannot_finish")
    # not before its deadline (ended as expired, not answered: the engine was still hung)
    assert behind_at >= 1.2
    assert factor == before["speed_factor"]  # the 2.5 s hang taught the tracker nothing
    assert last.status_code == 200 and last.json()["outcome"] == "good"
    after = stats(url)
    assert delta(after, before) == {"good": 1, "error": 1, "rejected": 1, "expired": 1}
    assert settled(after) and after["stalled"] == 0


@pytest.mark.slow
def test_clients_hanging_up_while_waiting_and_while_served_free_their_slots(servers):
    url = servers["none"]
    before = stats(url)

    async def go():
        async with httpx.AsyncClient(
            base_url=url, timeout=10, limits=httpx.Limits(max_connections=None)
        ) as client:

            def post(tokens, timeout):
                return client.post(
                    GENERATE, json={"prompt": "x", "max_new_tokens": tokens}, timeout=timeout
                )

            # 8.5 s in service; its client leaves at 0.15 s
            served = asyncio.ensure_future(post(1000, 0.15))
            await asyncio.sleep(0.02)
            waiting = asyncio.ensure_future(post(64, 0.15))  # waits; its client leaves at 0.15 s
            await asyncio.sleep(0.03)
            third = asyncio.ensure_future(post(4, 10))
            for left in (served, waiting):
                with pytest.raises(httpx.TimeoutException):
                    await left
            seen = None
            for _ in range(50):
                seen = (await client.get("/stats")).json()
                if seen["cancelled"] - before["cancelled"] == 2:
                    break
                await asyncio.sleep(0.01)
            return seen, await third

    during, third = asyncio.run(go())
    assert during["cancelled"] - before["cancelled"] == 2
    # The waiting one left the queue; the served one's engine was told to stop (the synthetic engine
    # listens), so the third did not wait out the 8.5 s run.
    assert third.status_code == 200 and third.json()["timings"]["queue_s"] < 5
    after = stats(url)
    assert delta(after, before) == {"good": 1, "abandoned": 2} and settled(after)


def _once_submitted(server: Server, n: int, stop) -> None:
    """``stop()`` once the server's gate has taken n requests: tied to the replay's progress, not to
    a clock that starts before the replay does (on a busy machine that start can take most of a
    second)."""
    while True:
        try:
            if httpx.get(f"{server.url}/stats", timeout=5).json()["submitted"] >= n:
                break
        except httpx.HTTPError:
            return
        time.sleep(0.01)
    stop()


@pytest.mark.slow
def test_server_killed_under_qlab_replay_then_a_second_replay_works(servers, tmp_path, capsys):
    server = Server(ServeOptions(policy="none"), tmp_path / "doomed.log")
    server.start(60)
    out = tmp_path / "run.parquet"
    # 29 requests of 4 tokens (35 ms each), 0.1 s apart: one engine, nobody waits.
    trace_csv = tmp_path / "trace.csv"
    trace_csv.write_text(
        "arrival_s,max_new_tokens\n" + "".join(f"{0.1 * i:.1f},4\n" for i in range(1, 30))
    )
    argv = [
        "replay",
        "--url",
        server.url,
        "--trace",
        str(trace_csv),
        "--timeout",
        "10",
        "--out",
        str(out),
    ]
    try:
        threading.Thread(
            target=_once_submitted, args=(server, 12, server.kill), daemon=True
        ).start()
        assert main(argv) == 0
    finally:
        server.stop()
    said = capsys.readouterr().out
    rows = records.validate(pd.read_parquet(out))
    assert f"wrote {len(rows)} rows" in said and list(rows["request_id"]) == list(
        range(len(rows))
    ) == list(range(29))
    # One engine, nobody waiting: answers in order until the kill, errors from then on.
    outcomes = rows["outcome"].tolist()
    first_error = outcomes.index("error")
    assert set(outcomes[:first_error]) == {"good"} and set(outcomes[first_error:]) == {"error"}, (
        outcomes
    )
    # killed once 12 were taken: up at first, then the rest failed
    assert 8 <= first_error <= 15, outcomes
    errors = rows[rows["outcome"] == "error"]
    assert errors["error"].notna().all() and errors["http_status"].isna().all()
    assert errors["finish_s"].notna().all()  # the time the failure was seen
    argv[argv.index(server.url)] = servers["none"]
    assert main(argv) == 0
    again = records.validate(pd.read_parquet(out))
    assert len(again) == 29 and not (again["outcome"] == "error").any()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_batching_gate_dying_under_qlab_replay_loses_no_row(tmp_path, capsys, sig):
    """Issue 32: the step log read after the run is optional; a gate gone by then costs the run its
    steps, and says so (the file's metadata, one line on stderr), never its rows."""
    server = Server(ServeOptions(policy="none", batching=True), tmp_path / "doomed.log")
    server.start(60)
    out = tmp_path / "run.parquet"
    # 30 requests of 30 tokens (about 0.3 s each at the default step model), 0.05 s apart: several
    # in the batch at once, so the stop finds requests running.
    trace_csv = tmp_path / "trace.csv"
    rows_csv = "".join(f"{0.05 * i:.2f},30\n" for i in range(1, 31))
    trace_csv.write_text("arrival_s,max_new_tokens\n" + rows_csv)
    argv = [
        "replay",
        "--url",
        server.url,
        "--trace",
        str(trace_csv),
        "--timeout",
        "20",
        "--out",
        str(out),
    ]
    try:
        # The signal to the server process alone (SIGTERM: uvicorn's graceful stop).
        stop = functools.partial(server.proc.send_signal, sig)
        threading.Thread(target=_once_submitted, args=(server, 12, stop), daemon=True).start()
        assert main(argv) == 0
    finally:
        server.stop()
    said = capsys.readouterr()
    rows = records.validate(pd.read_parquet(out))
    # One row each.
    assert sorted(rows["request_id"]) == list(range(30)) and rows["request_id"].is_unique
    outcomes = rows["outcome"].value_counts().to_dict()
    assert set(outcomes) <= {"good", "late", "error"} and outcomes.get("error", 0) >= 10, outcomes
    assert outcomes.get("good", 0) + outcomes.get("late", 0) >= 1, outcomes
    assert "batch_steps" not in rows.columns  # no step log: no steps made up
    warnings = pd.read_parquet(out).attrs["qlab_run"]["warnings"]
    assert len(warnings) == 1 and "step log was not read" in warnings[0]
    lines = [line for line in said.err.splitlines() if "step log" in line]
    assert len(lines) == 1 and lines[0].startswith("qlab replay: warning:")
    assert "Traceback" not in said.err
    assert f"wrote 30 rows to {out}" in said.out


# ---------------------------------------------------------------- interrupted sweeps and live runs


def _child_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, group",
    [(signal.SIGINT, True), (signal.SIGTERM, False)],
    ids=["SIGINT-to-the-group", "SIGTERM-to-the-sweep"],
)
def test_sigint_or_sigterm_stops_a_sweep_in_one_line_and_it_resumes(tmp_path, sig, group):
    # Two cells, one fast and one slow: when the fast one is written its worker is idle, and an
    # idle pool worker that takes the Ctrl-C prints a traceback unless it ignores SIGINT. SIGTERM
    # (`kill PID`) would end the sweep without its clean-up; it is an interrupt as SIGINT is (issue
    # 32).
    path = tmp_path / "s.toml"
    path.write_text(
        "[sweep]\nduration_s = 8000\nseeds = 1\n[grid]\npolicy = ['none']\nload = [0.05, 3.0]\n"
    )
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "experiments",
            "sweep",
            str(path),
            "--out",
            str(out),
            "--workers",
            "2",
            "--quiet",
        ],
        env=_child_env(),
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    end = time.monotonic() + 60
    while not list((out / "cells").glob("*.parquet")):
        assert time.monotonic() < end and proc.poll() is None, "the sweep wrote nothing"
        time.sleep(0.02)
    if group:
        os.killpg(proc.pid, sig)  # what Ctrl-C does: the whole foreground group
    else:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err == "qlab: interrupted\n", err
    written = list((out / "cells").glob("*.parquet"))
    assert len(written) == 1 and not list(out.rglob(".*tmp*"))
    pd.read_parquet(written[0])
    summary = sweep.run(config.load(path), out, workers=1, quiet=True)
    assert summary.attrs == {"ran": 1, "skipped": 1} and len(summary) == 2


def _qlab(*argv: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "experiments", *argv],
        env=_child_env(),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _terminated(proc: subprocess.Popen, when) -> str:
    """SIGTERM ``proc`` (alone, as `kill PID` does) once ``when()``; its stderr, after checking it
    ended as an interrupt does: exit 130, one line, no traceback."""
    end = time.monotonic() + 120
    while not when():
        assert time.monotonic() < end and proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.terminate()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.endswith("qlab: interrupted\n"), err
    assert "Traceback" not in err, err
    return err


@pytest.mark.slow
def test_sigterm_of_simulate_out_leaves_no_partial_file(tmp_path):
    """A streamed run writes row groups to a hidden .partial file: SIGTERM mid-run removes it
    (issue 32)."""
    proc = _qlab("simulate", "--requests", "3000000", "--out", "run.parquet", cwd=tmp_path)
    partial = tmp_path / ".run.parquet.partial"
    # Once a row group is written.
    _terminated(proc, lambda: partial.exists() and partial.stat().st_size > 0)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_sigterm_of_qlab_serve_is_its_graceful_stop_not_an_interrupt(tmp_path):
    """qlab serve keeps its own SIGTERM: uvicorn stops gracefully, then the process dies by the
    signal, which systemd and the like count as a clean stop (an interrupt's 130 would not be)."""
    proc = _qlab("serve", "--port", "0", cwd=tmp_path)
    assert "listening on" in proc.stdout.readline()
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM and "interrupted" not in err, err


@pytest.mark.slow
def test_sigterm_of_replay_out_leaves_no_file(servers, tmp_path):
    """SIGTERM mid-replay: no run file, and no temporary beside where it would have been (issue
    32)."""
    trace_csv = tmp_path / "trace.csv"
    rows_csv = "".join(f"{0.1 * i:.1f},4\n" for i in range(1, 200))
    trace_csv.write_text("arrival_s,max_new_tokens\n" + rows_csv)
    out = tmp_path / "out"
    out.mkdir()
    before = stats(servers["none"])["submitted"]
    proc = _qlab(
        "replay",
        "--url",
        servers["none"],
        "--trace",
        str(trace_csv),
        "--out",
        "run.parquet",
        cwd=out,
    )
    _terminated(proc, lambda: stats(servers["none"])["submitted"] >= before + 5)
    assert list(out.iterdir()) == []


def _running(process) -> bool:
    """Still running: a dead orphan may stay a zombie a while if nobody reaps it (PID 1 in a
    container)."""
    psutil = pytest.importorskip("psutil")
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _sweep_process(path, out, *flags: str, start_new_session: bool = False) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "experiments",
            "sweep",
            str(path),
            "--out",
            str(out),
            *flags,
            "--quiet",
        ],
        env=_child_env(),
        cwd=ROOT,
        start_new_session=start_new_session,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.mark.slow
def test_sigkilled_sweep_leaves_no_pool_workers_behind(tmp_path):
    # kill -9 runs no cleanup in the sweep: its pool workers must end by themselves (they ask the
    # kernel to kill them with their parent), not wait on their call queue forever as orphans.
    psutil = pytest.importorskip("psutil")
    path = tmp_path / "s.toml"
    path.write_text(
        "[sweep]\nduration_s = 400\nseeds = 3\n[grid]\npolicy = ['none', 'bounded', "
        "'bounded-deadline', "
        "'predictive']\nload = [0.5, 1.5]\nspeed = [1.0, 2.25]\n"
    )  # 48 cells
    out = tmp_path / "out"
    proc = _sweep_process(path, out, "--workers", "2", start_new_session=True)
    workers = []
    try:
        parent = psutil.Process(proc.pid)
        end = time.monotonic() + 60
        # Cells are being written and both workers exist (a fork pool starts them at the first
        # submit).
        while not (list((out / "cells").glob("*.parquet")) and len(workers) >= 2):
            assert time.monotonic() < end and proc.poll() is None, (
                f"the sweep wrote nothing: {workers}"
            )
            workers = parent.children(recursive=True)
            time.sleep(0.02)
        proc.kill()  # the parent only, as `kill -9 PID` does
        proc.wait()
        assert len(list((out / "cells").glob("*.parquet"))) < 48, (
            "the sweep should have been killed part way"
        )
        end = time.monotonic() + 20
        while alive := [w for w in workers if _running(w)]:
            assert time.monotonic() < end, f"pool workers outlived a SIGKILLed sweep: {alive}"
            time.sleep(0.05)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of its session
        except ProcessLookupError:
            pass
        proc.wait()


@pytest.mark.slow
def test_sigkilled_sweep_on_a_dask_cluster_leaves_no_tasks_behind(tmp_path):
    # There the workers are the cluster's and stay; what must not stay is the dead client's work.
    distributed = pytest.importorskip("distributed")
    path = tmp_path / "s.toml"
    path.write_text(
        "[sweep]\nduration_s = 400\nseeds = 3\n[grid]\npolicy = ['none', 'bounded']\n"
        "load = [0.5, 1.5]\nspeed = [1.0, 2.25]\n"
    )  # 24 cells
    out = tmp_path / "out"
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        proc = _sweep_process(path, out, "--scheduler", cluster.scheduler_address)
        try:
            end = time.monotonic() + 60
            while not list((out / "cells").glob("*.parquet")):
                assert time.monotonic() < end and proc.poll() is None, "the sweep wrote nothing"
                time.sleep(0.02)
        finally:
            proc.kill()
            proc.wait()
        assert len(list((out / "cells").glob("*.parquet"))) < 24, (
            "the sweep should have been killed part way"
        )
        end = time.monotonic() + 20
        while tasks := client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)):
            assert time.monotonic() < end, f"the scheduler kept {tasks} tasks of a SIGKILLed sweep"
            time.sleep(0.1)


LIVE_TOML = """
[server]
policies = ["bounded", "predictive"]
startup_timeout_s = 60
[probe]
requests = 1
[[trace]]
name = "burst"
arrivals = "burst:6"
[[trace]]
name = "poisson"
nominal_load = [0.8, 1.0]
seconds = 0.6
"""
RUNS = 6  # 3 traces (the burst and poisson at two loads) x 2 policies


class _Live:
    """`qlab live` in a subprocess; its stdout lines are collected as they come."""

    def __init__(self, path: Path, out: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "experiments", "live", str(path), "--out", str(out)],
            env=_child_env(),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(
            target=lambda: self.lines.extend(self.proc.stdout), daemon=True
        )
        self._reader.start()
        self.out = out

    def wait_for_runs(self, n: int, timeout_s: float = 60) -> list:
        """Once n run files exist: the live servers (this process's children)."""
        self._wait(lambda: self.written() >= n, timeout_s)
        return self.servers()

    def wait_for_a_run_in_progress(self, files_before: int, timeout_s: float = 60) -> list:
        """Once this process has started a run it has not written (a Poisson run lasts over 0.6
        s): the servers."""
        self._wait(lambda: self.started() > self.written() - files_before, timeout_s)
        return self.servers()

    def written(self) -> int:
        return len(list((self.out / "runs").glob("*.parquet")))

    def started(self) -> int:
        # live_runner.py logs "NAME (N requests) under ..."
        return sum(") under " in line for line in list(self.lines))

    def servers(self) -> list:
        return pytest.importorskip("psutil").Process(self.proc.pid).children(recursive=True)

    def _wait(self, done, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < end and self.proc.poll() is None, f"not reached: {self.lines}"
            time.sleep(0.02)


@pytest.mark.slow
def test_interrupted_live_runs_leave_whole_files_stop_their_servers_and_resume(tmp_path):
    psutil = pytest.importorskip("psutil")
    path = tmp_path / "live.toml"
    path.write_text(LIVE_TOML)
    out = tmp_path / "out"

    # SIGKILL: nothing in the runner can react; the servers see their stdin pipe close and stop.
    live = _Live(path, out)
    children = live.wait_for_runs(1)
    assert children, "the live servers should be children of qlab live"
    live.proc.kill()
    live.proc.wait()
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"servers outlived a SIGKILLed qlab live: {alive}"
    first = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*.parquet")}
    for p in first:
        records.validate(pd.read_parquet(p))

    # SIGINT in the middle of a run, after one more is written: one line, exit 130, servers stopped
    # on the way out; the earlier files untouched.
    assert len(first) + 2 <= RUNS, (
        f"the SIGKILL came too late to leave two runs for the SIGINT: {len(first)}"
    )
    live = _Live(path, out)
    live.wait_for_runs(len(first) + 1)
    children = live.wait_for_a_run_in_progress(len(first))
    live.proc.send_signal(signal.SIGINT)
    _, err = live.proc.communicate(timeout=60)
    assert live.proc.returncode == 130 and err.strip().splitlines()[-1] == "qlab: interrupted", err
    assert "Traceback" not in err
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive
    assert any(line.startswith(f"resuming: {len(first)} of {RUNS} runs") for line in live.lines), (
        live.lines
    )
    second = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*.parquet")}
    assert all(second[p] == t for p, t in first.items()) and len(second) > len(first)

    # Resume to the end: only the missing runs run; the summary covers them all.
    logged = []
    summary = runner.run(live_config.load(path), out, log=logged.append)
    assert len(summary) == RUNS and (summary["error"] == 0).all()
    assert logged[0].startswith(f"resuming: {len(second)} of {RUNS} runs")
    assert all(p.stat().st_mtime_ns == t for p, t in second.items())
    assert not list(out.rglob(".*tmp*"))
    assert list(summary["policy"]) == [
        "bounded",
        "predictive",
        "predictive",
        "bounded",
        "bounded",
        "predictive",
    ]


def test_sigterm_interrupts_a_live_run_as_sigint_does():
    """SIGTERM would end Python without running `finally`; inside a live run it raises
    KeyboardInterrupt, so the servers are stopped on the way out exactly as for SIGINT (tested
    above)."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with runner.sigterm_interrupts():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode boundary: well before this ends
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_live_folder_of_another_config_is_refused(tmp_path):
    path = tmp_path / "live.toml"
    path.write_text(LIVE_TOML)
    out = tmp_path / "out"
    cfg = live_config.load(path)
    (out / "runs").mkdir(parents=True)
    runner.check_folder(cfg, out)
    (out / "runs" / "burst__bounded.parquet").write_bytes(b"")  # a run of that config
    path.write_text(LIVE_TOML.replace("burst:6", "burst:7"))
    with pytest.raises(ValueError, match="another live config"):
        runner.check_folder(live_config.load(path), out)

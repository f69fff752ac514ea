"""Impatient, retrying clients against a real `qlab serve --engine synthetic` (loopback), and the
simulator re-run by `qlab compare` with the same clients (qsim.clients: one copy of the rules for
both).

The counts are exact, not within margins: every attempt the client sent reached the gate (the
patience below is a whole number of seconds plus a half, and Retry-After is whole seconds, so no
retry leaves within a moment of its client's hang-up), and the gate counts each once. One race is
real and is allowed for by an inequality rather than a tolerance: an answer already on its way back
when its client hangs up is counted by the gate as answered and by the client as abandoned.
"""

import json
import re

import numpy as np
import pandas as pd
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from analysis.compare import compare  # noqa: E402
from analysis.metrics import end_to_end, retry_summary  # noqa: E402
from experiments.cli import main  # noqa: E402
from live import live_config  # noqa: E402
from live.procs import serving  # noqa: E402
from live.serve_options import ServeOptions  # noqa: E402
from qsim import records  # noqa: E402
from qsim.clients import RetryPolicy  # noqa: E402

CLIENTS = [
    "--retry",
    "exponential",
    "--retry-jitter",
    "1",
    "--retry-max-attempts",
    "3",
    "--patience",
    "deterministic:3.5",
]


@pytest.fixture(scope="module")
def predictive(tmp_path_factory):
    with serving([ServeOptions(policy="predictive")], tmp_path_factory.mktemp("logs"), 60) as (
        server,
    ):
        yield server


def stats(url):
    body = httpx.get(f"{url}/stats").json()
    return {**body["counts"], "cancelled": body["cancelled"], "submitted": body["submitted"]}


@pytest.mark.slow
def test_impatient_retrying_clients_against_a_live_gate(predictive, tmp_path, capsys):
    out = tmp_path / "run.parquet"
    before = stats(predictive.url)
    assert (
        main(
            [
                "replay",
                "--url",
                predictive.url,
                "--arrivals",
                "poisson",
                "--nominal-load",
                "2",
                "--seconds",
                "8",
                "--seed",
                "11",
                *CLIENTS,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    after = stats(predictive.url)
    text = capsys.readouterr().out
    for needle in (
        "end to end, ",
        "retries: ",
        "Retry-After adherence 1.000",
        "retry send lateness: p50",
    ):
        assert needle in text, text
    rows = records.validate(pd.read_parquet(out))
    n = int(rows["attempt"].eq(1).sum())
    assert f"wrote {len(rows)} rows" in text and len(rows) > n  # some requests were sent again

    # Client and server count the same attempts.
    served = {o: after[o] - before[o] for o in after}
    mine = rows["outcome"].value_counts()
    assert served["submitted"] == len(rows), (served, mine)
    for outcome in ("rejected", "expired", "error"):
        assert served[outcome] == mine.get(outcome, 0), (outcome, served, mine)
    abandoned = mine.get("abandoned", 0)
    answered = mine.get("good", 0) + mine.get("late", 0)
    assert served["good"] + served["late"] + served["cancelled"] == answered + abandoned
    # an answer in flight at the hang-up is the gate's answered
    assert served["cancelled"] <= abandoned
    # Whether any client's patience runs out here depends on how fast a shared machine serves (a CI
    # run with other work on its two cores saw none): the hang-up's accounting is checked above
    # whatever the count.
    assert set(rows.loc[rows["outcome"].eq("abandoned"), "reason"]) <= {"client_left"}

    # Attempts: numbered 1, 2, ... per request, at most 3, each retry after a 503 or 429 and no
    # sooner than the Retry-After it was given; request ids of retries follow the trace's.
    assert (
        list(rows["request_id"]) == list(range(len(rows))) and rows["attempt"].iloc[:n].eq(1).all()
    )
    by_request = rows.sort_values(["first_request_id", "attempt"])
    assert (
        by_request.groupby("first_request_id")["attempt"].apply(
            lambda a: list(a) == list(range(1, len(a) + 1))
        )
    ).all()
    assert rows["attempt"].max() <= 3
    previous = by_request.groupby("first_request_id").shift(1)
    retried = by_request["attempt"] > 1
    assert previous.loc[retried, "http_status"].isin([503, 429]).all()
    assert (previous.loc[retried, "client_next"] == "retry").all()
    assert (
        by_request.loc[retried, "scheduled_s"]
        >= previous.loc[retried, "finish_s"] + previous.loc[retried, "retry_after_s"].astype(float)
    ).all()
    assert retry_summary(rows)["retry_after_adherence"] == 1.0
    # Patience counts from the first send: every hang-up is there, and no attempt was sent after it.
    first_sent = by_request.groupby("first_request_id")["arrival_s"].transform("first")
    np.testing.assert_allclose(by_request["hangup_s"], first_sent + 3.5)
    assert (by_request["arrival_s"] < by_request["hangup_s"]).all()
    left = by_request["outcome"].eq("abandoned")
    assert (by_request.loc[left, "finish_s"] >= by_request.loc[left, "hangup_s"]).all()

    # Every request has exactly one end-to-end outcome.
    e2e = end_to_end(rows)
    assert sorted(e2e["first_request_id"]) == list(range(n)) and e2e["outcome"].notna().all()
    assert e2e["attempts"].sum() == len(rows)

    # The simulator, re-run by compare with the run's retry policy and patience, agrees per request.
    assert main(["compare", str(out), "--out", str(tmp_path / "cmp")]) == 0
    said = capsys.readouterr().out
    assert "and the run's patience and retry policy" in said and "end to end, per request" in said
    result = compare(rows)
    s = result.summary
    assert s["requests_e2e"] == n and s["live_attempts"] == len(rows)
    assert s["e2e_disagreement_rate"] < 0.01, result.requests.query("~agree")
    assert s["disagreement_rate"] < 0.01, result.joined.query("~agree")
    assert pd.read_parquet(tmp_path / "cmp" / "requests.parquet")["first_request_id"].is_unique


@pytest.mark.slow
def test_a_client_timeout_is_abandoned_and_retried(predictive, tmp_path, capsys):
    # A burst of 64-token requests (0.55 s each) whose clients wait 0.25 s per attempt: the first
    # runs and times out, the waiting time out, the rest are refused; a timed-out attempt had no
    # answer and is sent again after 0.1 s, up to twice. The gate hears each hang-up (cancelled) as
    # the client made it.
    trace = tmp_path / "long.csv"
    pd.DataFrame({"arrival_s": [0.0] * 4, "max_new_tokens": [64] * 4}).to_csv(trace, index=False)
    out = tmp_path / "timeout.parquet"
    before = stats(predictive.url)
    assert (
        main(
            [
                "replay",
                "--url",
                predictive.url,
                "--trace",
                str(trace),
                "--retry",
                "fixed",
                "--retry-delay",
                "0.1",
                "--retry-max-attempts",
                "2",
                "--retry-timeout",
                "0.25",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    after = stats(predictive.url)
    capsys.readouterr()
    rows = records.validate(pd.read_parquet(out))
    timed_out = rows["reason"].eq("client_timeout")
    assert timed_out.any() and rows.loc[timed_out, "outcome"].eq("abandoned").all()
    np.testing.assert_allclose(rows["hangup_s"] - rows["arrival_s"], 0.25)
    firsts = rows[rows["attempt"].eq(1)].set_index("request_id")
    again = set(rows.loc[rows["attempt"].eq(2), "first_request_id"])
    # no answer: sent again
    assert set(firsts.index[firsts["reason"].eq("client_timeout")]) <= again
    assert set(firsts.loc[firsts["reason"].eq("client_timeout"), "client_next"]) == {"retry"}
    assert set(rows.loc[rows["attempt"].eq(2), "client_next"]) <= {
        "exhausted",
        "answered",
        "not_retryable",
    }
    assert after["submitted"] - before["submitted"] == len(rows)
    assert after["cancelled"] - before["cancelled"] == rows["outcome"].eq("abandoned").sum()


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--patience", "deterministic:2", "--patience-until", "start"],
            "--patience-until start is simulator-only",
        ),
        (["--patience-until", "answer"], "--patience-until needs --patience"),
        (["--patience", "gamma:2"], "bad patience 'gamma:2'"),
        (["--patience", "deterministic:-1"], "must be a positive number of seconds"),
        (["--retry", "exponential", "--retry-jitter", "2"], "retry jitter must be in [0, 1]"),
        (["--retry-delay", "1"], "--retry-delay needs a retry mode"),
        (
            ["--retry", "fixed", "--retry-max-attempts", "0"],
            "max_attempts must be a whole number >= 1",
        ),
        (["--retry", "fixed", "--retry-timeout", "0"], "timeout_s must be a positive number"),
        (["--retry", "sometimes"], "argument --retry: invalid choice"),
        (
            ["--retry", "fixed", "--retry-delay", "soon"],
            "argument --retry-delay: value must be a float",
        ),
    ],
)
def test_bad_client_settings_are_one_line_before_anything_is_sent(flags, message, tmp_path, capsys):
    # Nothing listens on port 9 and the load needs the server's engines: the settings are refused
    # first.
    assert (
        main(
            ["replay", "--url", "http://127.0.0.1:9", *flags, "--out", str(tmp_path / "x.parquet")]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "x.parquet").exists()


LIVE = "[[trace]]\nname = 'p'\nseconds = 2\n"


def test_live_files_take_patience_and_a_retry_table(tmp_path):
    path = tmp_path / "live.toml"
    path.write_text(
        "[replay]\npatience = 'exponential:20'\n[retry]\nmode = 'exponential'\njitter "
        "= 1.0\n"
        "max_attempts = 4\ntimeout_s = 30\n" + LIVE
    )
    cfg = live_config.load(path)
    assert cfg.retry == RetryPolicy(mode="exponential", jitter=1.0, max_attempts=4, timeout_s=30.0)
    assert (
        cfg.replay.clients_patience.spec == "exponential:20"
        and cfg.replay.clients_patience.until == "answer"
    )
    path.write_text(LIVE)
    plain = live_config.load(path)
    assert plain.retry is None and plain.replay.clients_patience is None


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "[replay]\npatience = 'deterministic:3'\npatience_until = 'start'\n",
            "replay.patience_until: start is simulator-only",
        ),
        ("[replay]\npatience_until = 'answer'\n", "replay.patience_until: needs replay.patience"),
        (
            "[replay]\npatience = 'column'\n",
            "replay.patience: 'column' reads a trace file's patience_s column",
        ),
        ("[replay]\npatience = 'weibull:3'\n", "replay.patience: bad patience 'weibull:3'"),
        ("[retry]\nmode = 'fixed'\njitter = 3.0\n", "retry: retry jitter must be in [0, 1]"),
        ("[retry]\nmode = 'fixed'\ndelay = 1.0\n", "retry: unknown retry setting 'delay'"),
        ("[retry]\ndelay_s = 1.0\n", "retry.delay_s needs a retry mode"),
        ("[retry]\nmode = 'fixed'\nmax_attempts = 2.5\n", "retry.max_attempts: expected int"),
    ],
)
def test_live_file_client_errors_name_the_key(tmp_path, capsys, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text + LIVE)
    with pytest.raises(ValueError, match=re.escape(message)):
        live_config.load(path)
    # Through the command line: one line, exit 2, nothing started.
    assert main(["live", str(path), "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and not (tmp_path / "never").exists()


@pytest.mark.slow
def test_qlab_live_replays_with_the_files_clients(tmp_path):
    from experiments import live_runner as runner

    path = tmp_path / "live.toml"
    path.write_text(
        "[server]\npolicies = ['predictive']\nstartup_timeout_s = "
        "60\n[probe]\nrequests = 2\n"
        "[replay]\npatience = 'deterministic:2.5'\n[retry]\nmode = "
        "'fixed'\nmax_attempts = 2\n"
        "[[trace]]\nname = 'p'\nnominal_load = 2.5\nseconds = 3\nseed = 4\n"
    )
    summary = runner.run(live_config.load(path), tmp_path / "out", log=lambda line: None)
    rows = records.validate(pd.read_parquet(tmp_path / "out" / "runs" / "p__predictive.parquet"))
    assert RetryPolicy.from_table(json.loads(rows["retry_policy"].iloc[0])) == RetryPolicy(
        mode="fixed", max_attempts=2
    )
    assert (rows["patience_s"] == 2.5).all() and rows["attempt"].max() <= 2
    row = summary.iloc[0]
    assert row["requests"] == len(rows) and row["sim_e2e_disagreement_rate"] < 0.01
    if rows["attempt"].gt(1).any():
        assert row["retry_after_adherence"] == 1.0

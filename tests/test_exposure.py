"""What the gate tells whom (issue 32, section 2): an upstream URL's password nowhere, the
upstream's address not to callers without a key, Host names it answers to (DNS rebinding), and an
access log without secrets.

In-process (FastAPI's TestClient); the upstream is a loopback port nothing listens on, so every run
fails there and says where, which is what must not leak.
"""

import base64
import logging
import socket

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from experiments.cli import main  # noqa: E402
from live.auth import load_keys  # noqa: E402
from live.engine import SyntheticEngine  # noqa: E402
from live.gate import Gate, gate_config  # noqa: E402
from live.hosts import AccessLog, HostAllowList, host_name, without_addresses  # noqa: E402
from live.http_api import create_app  # noqa: E402
from live.serve_options import check_upstream_url, redacted, split_credentials  # noqa: E402
from live.upstream import UpstreamEngine, UpstreamSpec  # noqa: E402
from qsim import preset  # noqa: E402

SECRET = "hunter2"


def _closed_port() -> int:
    """A loopback port nothing listens on (bound for a moment, never listening: connections are
    refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------- the URL's user info


@pytest.mark.parametrize(
    "url, shown",
    [
        ("http://user:hunter2@gpu.example:8001/v1", "http://***@gpu.example:8001/v1"),
        (
            "https://user:p@ss:w@rd@gpu.example",
            "https://***@gpu.example",
        ),  # a raw @ in the password
        ("http://hunter2@gpu.example", "http://***@gpu.example"),
        # Too broken to parse:
        ("http://user:hunter2@gpu.example:notaport", "http://***@gpu.example:notaport"),
        ("http://gpu.example:8001", "http://gpu.example:8001"),
        ("http://gpu.example/a@b", "http://gpu.example/a@b"),  # an @ in the path is no user info
    ],
)
def test_redacted_hides_the_user_info_and_nothing_else(url, shown):
    assert redacted(url) == shown


def test_a_bad_upstream_url_is_refused_without_its_password():
    with pytest.raises(ValueError) as refused:
        check_upstream_url("ftp://user:hunter2@gpu.example")
    assert SECRET not in str(refused.value) and "***@gpu.example" in str(refused.value)


def test_the_urls_user_info_is_basic_auth_and_a_key_wins():
    spec = UpstreamSpec("http://user:p%40ss@gpu.example:8001/v1", "m")
    assert spec.url == "http://gpu.example:8001" and spec.basic == ("user", "p@ss")
    assert spec.headers == {"authorization": "Basic " + base64.b64encode(b"user:p@ss").decode()}
    assert "p@ss" not in repr(spec) and "p%40ss" not in repr(spec)
    keyed = UpstreamSpec("http://user:p%40ss@gpu.example:8001", "m", api_key="sk-up")
    # One Authorization header: the key's.
    assert keyed.headers == {"authorization": "Bearer sk-up"}
    assert split_credentials("http://gpu.example")[1] is None
    from dataclasses import replace

    assert replace(spec, timeout_s=5.0).basic == ("user", "p@ss")  # kept when the spec is remade


# ---------------------------------------------------------------- what the gate says of its
# upstream


def _upstream_gate(**app) -> TestClient:
    """A gate forwarding to user:hunter2@ a port nobody listens on."""
    spec = UpstreamSpec(f"http://user:{SECRET}@127.0.0.1:{_closed_port()}", "m", timeout_s=2.0)
    gate = Gate([UpstreamEngine(spec, "m")], gate_config(preset("none")))
    return TestClient(create_app(gate, **app))


def test_no_answer_names_the_upstreams_password():
    with _upstream_gate() as client:
        answers = [
            client.get("/stats"),
            client.get("/healthz"),
            client.get("/ready"),
            client.post("/v1/generate", json={"prompt": "hi", "max_new_tokens": 2}),
            client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}),
        ]
    assert [a.status_code for a in answers] == [200, 200, 503, 502, 502]
    # A keyless gate still says where it failed.
    assert "127.0.0.1" in answers[3].json()["error"]["message"]
    assert all(SECRET not in a.text and "user:" not in a.text for a in answers)


def test_with_keys_the_open_routes_do_not_say_where_the_upstream_is():
    keys = load_keys("sk-gate", None)
    with _upstream_gate(keys=keys) as client:
        ready, health = client.get("/ready"), client.get("/healthz")
        keyed = client.get("/stats")
        failed = client.post(
            "/v1/generate",
            json={"prompt": "hi", "max_new_tokens": 2},
            headers={"authorization": "Bearer sk-gate"},
        )
    assert ready.status_code == 503 and "the upstream" in ready.json()["error"]["message"]
    assert health.json()["ready"] is False and health.json()["not_ready"]
    assert "url" not in health.json()["engine"]
    for answer in (ready, health):
        assert "127.0.0.1" not in answer.text and SECRET not in answer.text
    # A caller with a key (every /v1/ route) is told; /stats is open here and says it too
    # (--auth-stats guards it).
    assert keyed.json()["engine"]["url"].startswith("http://127.0.0.1:")
    assert failed.status_code == 502 and "127.0.0.1" in failed.json()["error"]["message"]


def test_with_auth_stats_healthz_is_for_key_holders_and_says_where():
    with _upstream_gate(keys=load_keys("sk-gate", None, guard_stats=True)) as client:
        health = client.get("/healthz", headers={"authorization": "Bearer sk-gate"})
        ready = client.get("/ready")
    assert health.json()["engine"]["url"].startswith("http://127.0.0.1:")
    assert SECRET not in health.text
    assert "127.0.0.1" not in ready.text


def test_without_addresses_replaces_the_longest_first():
    said = without_addresses(
        ["http://h:1/v1/models: cannot reach", "busy"], {"http://h:1", "http://h:1/v1"}
    )
    assert said == ["the upstream/models: cannot reach", "busy"]


# ---------------------------------------------------------------- Host names


@pytest.mark.parametrize(
    "header, name",
    [
        ("localhost:8000", "localhost"),
        ("[::1]:8000", "::1"),
        ("[::1]", "::1"),
        ("Example.COM.", "example.com"),
        ("127.0.0.1", "127.0.0.1"),
    ],
)
def test_host_name_drops_the_port_even_of_an_ipv6_literal(header, name):
    assert host_name(header) == name


def _plain_gate(**app) -> TestClient:
    gate = Gate([SyntheticEngine(speed=1e-4)], gate_config(preset("none"), fixed_estimate=True))
    return TestClient(create_app(gate, **app))


@pytest.mark.parametrize(
    "host, allowed",
    [
        ("localhost:8000", True),
        ("127.0.0.1:8000", True),
        ("[::1]:8000", True),
        ("LOCALHOST", True),
        ("rebound.attacker.example", False),
        ("localhost.attacker.example:8000", False),
        ("127.0.0.2", False),
        ("", False),
    ],
)
def test_a_loopback_gate_answers_loopback_names_alone(host, allowed):
    with _plain_gate(hosts=HostAllowList.for_bind(True)) as client:
        answer = client.get("/stats", headers={"host": host})
        after = client.get("/health", headers={"host": "localhost"})
    if allowed:
        assert answer.status_code == 200
    else:
        error = answer.json()["error"]
        assert answer.status_code == 421
        assert (error["type"], error["reason"]) == ("invalid_request", "host_not_allowed")
        assert not host or host not in answer.text  # the name asked for is not repeated
    assert after.status_code == 200  # the service keeps serving


def test_allowed_hosts_widen_the_list_and_a_gate_bound_elsewhere_answers_any_name():
    wider = HostAllowList.for_bind(True, ["gate.example", "*.corp.example"])
    assert all(wider.allows(h) for h in (b"gate.example:443", b"a.corp.example", b"localhost"))
    assert not wider.allows(b"corp.example") and not wider.allows(None)
    assert HostAllowList.for_bind(False) is None  # no list: any name
    assert HostAllowList.for_bind(False, ["gate.example"]).allows(b"gate.example")
    assert HostAllowList.for_bind(True, ["*"]).allows(b"anything.example")
    with _plain_gate(hosts=wider) as client:
        assert (
            client.post(
                "/v1/generate",
                json={"prompt": "hi", "max_new_tokens": 2},
                headers={"host": "x.corp.example"},
            ).status_code
            == 200
        )
        assert (
            client.post(
                "/v1/generate",
                json={"prompt": "hi", "max_new_tokens": 2},
                headers={"host": "evil.example"},
            ).status_code
            == 421
        )


@pytest.mark.parametrize("value", ["a/b", "", "user@host", "*x.example"])
def test_a_bad_allowed_host_is_one_line_and_exit_2(value, capsys):
    assert main(["serve", "--allowed-hosts", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--allowed-hosts" in err and "Traceback" not in err


# ---------------------------------------------------------------- the access log


def test_the_access_log_says_each_request_and_never_its_query_headers_or_body(caplog):
    gate = Gate([SyntheticEngine(speed=1e-4)], gate_config(preset("none")))
    app = AccessLog(
        create_app(gate, keys=load_keys("sk-gate", None), hosts=HostAllowList.for_bind(True))
    )
    with (
        caplog.at_level(logging.INFO, logger="qlab.access"),
        TestClient(app, base_url="http://localhost") as client,
    ):
        client.post(
            "/v1/generate",
            json={"prompt": "my secret prompt", "max_new_tokens": 2},
            headers={"authorization": "Bearer sk-gate"},
        )
        client.get("/stats", params={"steps_since": 0})
        client.get("/v1/models")  # no key: 401
        client.get("/health", headers={"host": "evil.example"})  # 421
    lines = [r.getMessage() for r in caplog.records if r.name == "qlab.access"]
    assert [line.split()[:3] for line in lines] == [
        ["POST", "/v1/generate", "200"],
        ["GET", "/stats", "200"],
        ["GET", "/v1/models", "401"],
        ["GET", "/health", "421"],
    ]
    assert all(line.split()[3].endswith("ms") for line in lines)
    assert all(line.split()[4].startswith("testclient:") for line in lines)
    text = "\n".join(lines)
    assert "sk-gate" not in text and "secret prompt" not in text and "steps_since" not in text


@pytest.mark.slow
def test_qlab_serve_refuses_a_rebound_host_and_logs_each_request(tmp_path):
    """The flags through a real ``qlab serve``: bound to loopback, a foreign Host is a 421;
    --access-log writes a line per request on stderr (the server's log here)."""
    from live.procs import Server
    from live.serve_options import ServeOptions

    options = ServeOptions(policy="none", access_log=True, allowed_hosts="gate.example")
    server = Server(options, tmp_path / "s.log")
    server.start(60)
    try:
        rebound = httpx.get(f"{server.url}/healthz", headers={"host": "rebound.attacker.example"})
        named = httpx.get(f"{server.url}/healthz", headers={"host": "gate.example:8000"})
        plain = httpx.get(f"{server.url}/stats?steps_since=0")  # the URL's own 127.0.0.1
    finally:
        server.stop()
    assert rebound.status_code == 421 and rebound.json()["error"]["reason"] == "host_not_allowed"
    assert named.status_code == 200 and plain.status_code == 200
    logged = [
        line for line in (tmp_path / "s.log").read_text().splitlines() if "qlab access:" in line
    ]
    assert any("GET /healthz 421" in line for line in logged)
    assert any("GET /stats 200" in line for line in logged)
    assert not any("steps_since" in line for line in logged)

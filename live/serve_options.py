"""The options of ``qlab serve``, written once.

:class:`ServeOptions` is the one list of them. From its fields come

- ``qlab serve``'s flags (:meth:`ServeOptions.add_flags`, :meth:`ServeOptions.from_args`): a field's
  flag is its name with dashes (``fail_every`` -> ``--fail-every``);
- the keys of a ``qlab live`` file's ``[server]`` table (:meth:`ServeOptions.toml_kinds`,
  :meth:`ServeOptions.from_table`), checked against the same choices and bounds as the flags;
- the command line of a server started as a child process (:meth:`ServeOptions.argv`).

A field's metadata (see :func:`_option`) holds its help text, its type (a parser from
:mod:`inputs.argtypes`, which also bounds a TOML value) or its choices, and:

- ``engine``: the one engine that takes it. On the command line it is an error with another
  engine; a child's argv leaves it out for the other engines (and a TOML value is then unused);
- ``required``: with its engine, it must be given (``--engine upstream`` needs ``--upstream-url``);
- ``toml``: False for what ``qlab live`` sets per server itself (policy, host, port, logging);
- ``check``: a function of the value that raises ValueError on a bad one;
- ``needs``: (another field, why): given without that one, it is an error.
"""

from __future__ import annotations

import argparse
import re
import sys
import types
import typing
from dataclasses import dataclass, field, fields, replace
from urllib.parse import unquote, urlsplit, urlunsplit

from inputs import argtypes
from inputs.batchflags import (
    BATCHING_FLAGS,
    BATCHING_HELP,
    BATCHING_ONLY,
    NO_CHUNKED_PREFILL_HELP,
    PREFIX_CACHING_HELP,
    STEP_METAVAR,
    batching_engine,
    parse_step,
)
from inputs.policyflags import from_options, policy_spec
from inputs.tomlfiles import ConfigError
from qsim.config import ServerConfig
from qsim.engines import Batching
from qsim.fleet import ADMISSION_AT, FleetSpec
from qsim.routers import ROUTERS, make_router
from qsim.policy import PRESETS
from qsim.service import LoadTerms

from .engine import parse_schedule

LOOPBACK = "127.0.0.1"
#: A fleet's options besides --replicas: refused for one server.
_FLEET_ONLY = (
    "router",
    "router_d",
    "admission_at",
    "replica_speeds",
    "replica_down",
    "replica_drain",
)


def _option(
    default,
    help: str | None = None,
    *,
    type=None,
    choices=None,
    metavar=None,
    engine=None,
    toml=True,
    check=None,
    needs=None,
    many=False,
    required=False,
    secret=False,
):
    """many: a flag that may be repeated; its values are kept joined by commas. secret: a key, never
    put on a child's command line (where other users could read it) nor in a TOML file; a child
    reads it from its environment instead."""
    return field(
        default=default,
        repr=not secret,
        metadata=dict(
            help=help,
            type=type,
            choices=choices,
            metavar=metavar,
            engine=engine,
            toml=toml and not secret,
            check=check,
            needs=needs,
            many=many,
            required=required,
            secret=secret,
        ),
    )


#: A URL's user info: everything between ``scheme://`` and the authority's last ``@`` (a raw ``@``
#: in a password included), before any path, query or fragment.
_USER_INFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@")


def redacted(url: str) -> str:
    """``url`` with its user info (``user:password@``) shown as ``***@``: what every message, log
    line and info dict says of an upstream URL. Never parses, so a URL too broken to parse is still
    redacted."""
    return _USER_INFO.sub(r"\1***@", url)


def split_credentials(url: str) -> tuple[str, tuple[str, str] | None]:
    """``url`` without its user info, and that user info (user, password; percent-decoded) or None.
    The gate sends them as HTTP basic auth (live.upstream.UpstreamSpec), never in the URL it shows
    or connects to."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    bare = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    return bare, (unquote(parts.username or ""), unquote(parts.password or ""))


def check_host_pattern(text: str) -> str:
    """An ``--allowed-hosts`` value: names, ``*.DOMAIN`` or ``*``, joined by commas; ValueError
    when one is empty or has a character no host name has."""
    for pattern in text.split(","):
        name = pattern.strip()
        body = name[2:] if name.startswith("*.") else name
        if name != "*" and (not body or any(c in body for c in "/?#@ *")):
            raise ValueError(f"--allowed-hosts: {name!r} is not a host name, *.DOMAIN or *")
    return text


def check_upstream_url(url: str) -> str:
    """The root URL of an OpenAI-compatible server, without a trailing slash or ``/v1`` (both are
    accepted: ``/v1`` is where an OpenAI client's base URL ends); ValueError when it is no http(s)
    URL (the message shows it :func:`redacted`)."""
    try:
        parts = urlsplit(url.strip())
        parts.port
    except ValueError:
        parts = None
    if (
        parts is None
        or parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.query
        or parts.fragment
    ):
        raise ValueError(
            f"the upstream URL must be http://HOST[:PORT] or https://HOST[:PORT], "
            f"got {redacted(url)!r}"
        )
    root = url.strip().rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def check_upstream_urls(text: str) -> list[str]:
    """``--upstream-url`` given once or more (kept joined by commas): each checked as
    :func:`check_upstream_url` does."""
    return [check_upstream_url(url) for url in text.split(",")]


@dataclass(frozen=True)
class ServeOptions:
    """Every option of ``qlab serve``; the defaults are the server's."""

    policy: str = _option(
        "none",
        f"a preset ({', '.join(PRESETS)}) or module:Class, a qsim.policy.Policy of your own",
        type=policy_spec,
        metavar="POLICY",
        toml=False,
    )
    policy_arg: str = _option(
        "",
        "a parameter of the policy, KEY=VALUE (repeat)",
        metavar="KEY=VALUE",
        toml=False,
        many=True,
    )
    max_queue: int | None = _option(
        None, "override the preset's bound on waiting requests", type=argtypes.count
    )
    deadline: float | None = _option(
        None, "override the default deadline (seconds)", type=argtypes.positive
    )
    engine: str = _option(
        "synthetic",
        "synthetic (sleeps the service model's time; default), "
        "gpt2, or upstream "
        "(forward to an OpenAI-compatible server: --upstream-url)",
        choices=("gpt2", "synthetic", "upstream"),
    )
    engines: int = _option(
        1, "engines behind the queue (K), one thread each", type=argtypes.positive_int
    )
    replicas: int = _option(
        1,
        "N replicas of the server, each its own --engines K, line and "
        "admission, behind --router (live.fleet_gate; default 1: one "
        "server); with --batching each one batching engine (synthetic); "
        "--engine upstream: one replica per --upstream-url",
        type=argtypes.positive_int,
    )
    router: str | None = _option(
        None,
        f"which replica an arrival goes to: {', '.join(ROUTERS)} "
        "(qsim.routers, the simulator's; default round_robin)",
        choices=tuple(ROUTERS),
        metavar="NAME",
    )
    router_d: int | None = _option(
        None, "power_of_d's choices (default 2)", type=argtypes.positive_int, metavar="D"
    )
    admission_at: str | None = _option(
        None,
        "where a fleet admits: replica (each replica's own admission on its own state, after "
        "routing; default) or gate (one admission on the fleet's state, before routing: "
        "qsim.gate_view, the simulator's --admission-at)",
        choices=ADMISSION_AT,
    )
    replica_speeds: str | None = _option(
        None,
        "synthetic: each replica's speed over the server's, one per replica (e.g. 1,1,0.5: the "
        "third's runs, or steps, take twice as long; the simulator's --replica-speeds); needs "
        "--replicas N",
        metavar="S,S,...",
        engine="synthetic",
        check=argtypes.replica_speeds,
    )
    replica_down: str | None = _option(
        None,
        "synthetic: replica R is down from FROM to TO seconds after the gate starts (repeat): "
        "what runs and waits there ends in error once, the router sends nothing there "
        "meanwhile (the simulator's --replica-down); needs --replicas N",
        metavar="R:FROM:TO",
        engine="synthetic",
        check=argtypes.replica_downs,
        many=True,
    )
    replica_drain: str | None = _option(
        None,
        "replica R drains from FROM to TO seconds after the gate starts (repeat): the router "
        "sends nothing there meanwhile, while what it holds, running and waiting, runs to its "
        "end (the simulator's --replica-drain; any engine: it is routing); needs --replicas N",
        metavar="R:FROM:TO",
        check=argtypes.replica_drains,
        many=True,
    )
    batching: bool = _option(
        False,
        BATCHING_HELP + ": the synthetic engine runs each step for its "
        "step model's "
        "time, gpt2 one forward pass over the batch; the gate drives "
        "it through the "
        "simulator's batching core (live.batching)",
    )
    step: str | None = _option(
        None, BATCHING_FLAGS["step"][2], metavar=STEP_METAVAR, check=parse_step
    )
    max_num_seqs: int | None = _option(
        None, BATCHING_FLAGS["max_num_seqs"][2], type=argtypes.positive_int
    )
    max_num_batched_tokens: int | None = _option(
        None, BATCHING_FLAGS["max_num_batched_tokens"][2], type=argtypes.positive_int
    )
    kv_blocks: int | None = _option(
        None, BATCHING_FLAGS["kv_blocks"][2], type=argtypes.positive_int
    )
    block_size: int | None = _option(
        None, BATCHING_FLAGS["block_size"][2], type=argtypes.positive_int
    )
    no_chunked_prefill: bool = _option(False, NO_CHUNKED_PREFILL_HELP)
    prefix_caching: bool = _option(
        False,
        PREFIX_CACHING_HELP + "; synthetic: each request's blocks hashed from its prompt's token "
        "ids (a prompt sent as ids, else its text's bytes), its steps computing only the uncached "
        "prompt tokens",
        engine="synthetic",
    )
    model: str = _option(
        "random",
        "gpt2: a hub name or local path, 'random' (GPT-2 small, random "
        "weights; default) "
        "or 'tiny' (2 layers, for tests)",
        engine="gpt2",
    )
    device: str = _option(
        "auto",
        "gpt2: where to run (default auto: cuda if available)",
        choices=("auto", "cuda", "cpu"),
        engine="gpt2",
    )
    threads: int | None = _option(
        None,
        "gpt2: torch CPU threads (default: torch's choice)",
        type=argtypes.positive_int,
        engine="gpt2",
    )
    speed: float = _option(
        1.0,
        "synthetic: service times are SPEED times the model (default 1)",
        type=argtypes.positive,
        engine="synthetic",
    )
    noise: float = _option(
        0.0,
        "synthetic: CV of lognormal noise on service times (with "
        "--batching: of the gamma "
        "noise on each step's time, the step model's CV)",
        type=argtypes.non_negative,
        engine="synthetic",
    )
    speed_schedule: str = _option(
        "",
        "synthetic: SECONDS:FACTOR,... speed changes since start, e.g. 20:2.2",
        engine="synthetic",
        check=parse_schedule,
    )
    early_stops: bool = _option(
        False,
        "synthetic: each run stops early as the reference study "
        "measured (a share of "
        "its limit, median 13 %%, 4 in 60 at the limit: qsim's "
        "UsedShare) and takes the "
        "time of the tokens it generated",
        engine="synthetic",
    )
    faulty_replica: int | None = _option(
        None,
        "synthetic, fault injection: --fail-every and "
        "--hang-after apply to this replica's engines only "
        "(from 0; default: every engine)",
        type=argtypes.count,
        metavar="R",
        engine="synthetic",
    )
    fail_every: int = _option(
        0,
        "synthetic, fault injection: every Nth run of an engine raises at once",
        type=argtypes.positive_int,
        metavar="N",
        engine="synthetic",
    )
    hang_after: int | None = _option(
        None,
        "synthetic, fault injection: run N+1 of an engine hangs "
        "(--hang-for "
        "seconds; default forever)",
        type=argtypes.count,
        metavar="N",
        engine="synthetic",
    )
    hang_for: float | None = _option(
        None,
        "synthetic: how long the hang lasts",
        type=argtypes.positive,
        metavar="SECONDS",
        engine="synthetic",
        needs=("hang_after", "which run hangs"),
    )
    upstream_url: str | None = _option(
        None,
        "upstream: the OpenAI-compatible server to forward "
        "to, e.g. "
        "http://127.0.0.1:8001 (vllm serve, or another qlab "
        "serve)",
        metavar="URL",
        engine="upstream",
        check=check_upstream_urls,
        required=True,
        many=True,
    )
    upstream_model: str | None = _option(
        None,
        "upstream: the model to ask for (default: the first the upstream's GET /v1/models lists)",
        metavar="NAME",
        engine="upstream",
    )
    upstream_timeout: float = _option(
        60.0,
        "upstream: a request fails as upstream_timeout (504) "
        "when the upstream "
        "sends nothing for this long (default 60 s)",
        type=argtypes.positive,
        metavar="SECONDS",
        engine="upstream",
    )
    upstream_api_key: str | None = _option(
        None,
        "upstream: the key to send it as Authorization: "
        "Bearer (default: "
        "the QLAB_UPSTREAM_API_KEY environment variable, "
        "which other users "
        "cannot read in the process list)",
        metavar="KEY",
        engine="upstream",
        secret=True,
    )
    default_max_tokens: int | None = _option(
        None,
        "OpenAI routes: the new tokens of a request "
        "that names no "
        "max_tokens (default: the most whose calibrated "
        "estimate fits its "
        "deadline, at most the cap)",
        type=argtypes.positive_int,
        metavar="N",
    )
    stall_factor: float = _option(
        10.0,
        "an engine is stalled once its request runs this many times its estimate (default 10) ...",
        type=argtypes.number(float, 1, strict=False),
    )
    stall_after: float = _option(
        5.0,
        "... and at least this long (default 5 s); its request then ends as an engine_error",
        type=argtypes.positive,
        metavar="SECONDS",
    )
    seed: int = _option(0, "random weights and synthetic noise", type=argtypes.count)
    service_model: str = _option(
        "",
        "JSON with intercept_s and per_token_s (from qlab calibrate); "
        "with --batching "
        "its fitted step model too, where --step does not say one",
    )
    fixed_estimate: bool = _option(False, "do not track speed: keep the calibrated estimate")
    api_key: str | None = _option(
        None,
        "every /v1/ route wants Authorization: Bearer KEY "
        "(default: the QLAB_API_KEY "
        "environment variable, which other users cannot read in "
        "the process list; "
        "none: open)",
        metavar="KEY",
        secret=True,
    )
    api_key_file: str | None = _option(
        None,
        "keys, one a line: KEY CLIENT_ID (the client "
        "per-client limits and fair "
        "share count by) or KEY alone",
        metavar="FILE",
    )
    admin_key: str | None = _option(
        None,
        "the operator's key, which PUT /admin/calibration wants "
        "(a new calibration "
        "without a restart: qlab calibrate --apply; default: the "
        "QLAB_ADMIN_KEY "
        "environment variable; none: the route refuses "
        "everyone)",
        metavar="KEY",
        secret=True,
    )
    auth_stats: bool = _option(
        False,
        "/stats, /healthz and /metrics want a key too (/health, "
        "/ready and "
        "/openapi.json stay open)",
    )
    allowed_hosts: str = _option(
        "",
        "a Host name the server answers to besides loopback's "
        "(localhost, 127.0.0.1, [::1]; repeat, or NAME,NAME; "
        "*.DOMAIN: any name under it; *: any). Bound to loopback "
        "it answers those alone by default (DNS rebinding), "
        "elsewhere any name unless this is given; other names: "
        "421 host_not_allowed",
        metavar="HOST",
        many=True,
        check=check_host_pattern,
    )
    access_log: bool = _option(
        False,
        "a line per request on stderr: method, path, status, "
        "milliseconds, client address (never a query, a header or a "
        "body)",
    )
    ssl_certfile: str | None = _option(
        None,
        "serve HTTPS with this certificate (PEM), with --ssl-keyfile (uvicorn's TLS)",
        metavar="FILE",
        needs=("ssl_keyfile", "the certificate's key"),
    )
    ssl_keyfile: str | None = _option(
        None,
        "the certificate's private key (PEM)",
        metavar="FILE",
        needs=("ssl_certfile", "the certificate"),
    )
    host: str = _option(
        LOOPBACK, f"address to bind (default {LOOPBACK}: this machine only)", toml=False
    )
    port: int = _option(
        8000, "0 picks a free port (printed on the first line)", type=argtypes.port, toml=False
    )
    http: str = _option(
        "httptools",
        "HTTP parser: httptools (default, fastest) or h11; both refuse a request head past 64 KiB",
        choices=("httptools", "h11"),
    )
    header_timeout: float = _option(
        10.0,
        "a request head must arrive within this many seconds of "
        "the connection's "
        "opening (or its first byte, on a kept-alive "
        "connection), else 408 and the "
        "connection is closed (default 10)",
        type=argtypes.positive,
        metavar="SECONDS",
    )
    body_timeout: float = _option(
        30.0,
        "a request body must arrive within this many seconds of "
        "its head, else 408 "
        "and the connection is closed (default 30)",
        type=argtypes.positive,
        metavar="SECONDS",
    )
    log_level: str = _option(
        "warning", choices=("critical", "error", "warning", "info", "debug"), toml=False
    )
    watch_stdin: bool = _option(
        False,
        "stop when stdin reaches end of file (for a parent process: the server goes when it goes)",
        toml=False,
    )

    def make_policy(self):
        """The policy these options name, with its parameters and the --max-queue / --deadline
        overrides."""
        from .gate import check_live_policy  # here: the gate loads asyncio and the engines' module

        return check_live_policy(
            from_options(self.policy, [self.policy_arg], self.max_queue, self.deadline)
        )

    def engine_model(self) -> Batching | None:
        """The batching engine these options describe (None: engines one at a time); ValueError for
        a combination that cannot run: a batching option without --batching, or with --batching an
        option that applies to engines run one at a time (each names what to use instead)."""
        batching = batching_engine(
            self.batching,
            {name: getattr(self, name) for name in BATCHING_ONLY},
            self.no_chunked_prefill,
            self.prefix_caching,
        )
        if batching is None:
            return None
        defaults = {f.name: f.default for f in fields(self)}
        unfit = (
            (self.engines != 1, "--batching runs one batching engine: drop --engines"),
            (
                self.noise and batching.step.cv,
                "--noise and --step's CV both set a batching engine's step noise: give one",
            ),
            (
                self.early_stops,
                "--early-stops: not with --batching (the batch runs each request to its limit)",
            ),
            (
                self.hang_after is not None and self.hang_for is None,
                "--hang-after with --batching needs --hang-for (a batching engine has no stall "
                "rule "
                "to end a hang)",
            ),
            (
                self.stall_factor != defaults["stall_factor"]
                or self.stall_after != defaults["stall_after"],
                "--stall-factor, --stall-after: engines run one at a time; a batching engine has "
                "no "
                "stall rule",
            ),
        )
        for bad, why in unfit:
            if bad:
                raise ValueError(why)
        if self.replicas > 1 and self.engine == "gpt2":
            raise ValueError(
                "--batching with replicas: --engine gpt2's batching serves one replica (a fleet "
                "of batching replicas runs --engine synthetic, or upstream with one "
                "--upstream-url each)"
            )
        calibrated = LoadTerms.load(self.service_model).step
        if self.step is None and calibrated is not None:  # --step given wins over the calibration's
            batching = replace(batching, step=calibrated)
        # the spread of a step's time around the model (a gamma of mean 1), the simulator's too
        if self.noise:
            batching = replace(batching, step=replace(batching.step, cv=self.noise))
        return batching

    def upstream_urls(self) -> list[str]:
        """Each ``--upstream-url`` given, in order (none for another engine)."""
        if self.engine != "upstream" or not self.upstream_url:
            return []
        return self.upstream_url.split(",")

    def fleet(self) -> FleetSpec | None:
        """The replicas and router these options ask for (None: one server); ValueError naming the
        flag where they do not fit."""
        n, urls = self.replicas, len(self.upstream_urls())
        if urls > 1 or (self.engine == "upstream" and n > 1):
            if n not in (1, urls):
                raise ValueError(
                    f"--replicas {n}: --engine upstream runs one replica per "
                    f"--upstream-url ({urls} given)"
                )
            n = urls
        if self.faulty_replica is not None and self.faulty_replica >= n:
            raise ValueError(f"--faulty-replica {self.faulty_replica}: replicas are 0..{n - 1}")
        if n == 1:
            given = [_flag(name) for name in _FLEET_ONLY if getattr(self, name) is not None]
            if given:
                raise ValueError(
                    f"{', '.join(given)}: a fleet's options, for --replicas N > 1 "
                    "(or several --upstream-url)"
                )
            return None
        fleet = FleetSpec(
            n,
            make_router(self.router or "round_robin", self.router_d),
            **self._replica_faults(),
            admission=self.admission_at or "replica",
        )
        # Replicas of engines one at a time, or of one batching engine each (the gate checks its
        # own config too).
        batching = self.engine_model()
        fleet.check(ServerConfig() if batching is None else ServerConfig(engine=batching))
        return fleet

    def _replica_faults(self) -> dict:
        """The speeds, down and drain windows of the fleet's replicas, the simulator's FleetSpec
        fields; ValueError for an engine whose speed is its own (a [server] table's keys are not
        checked per engine). A drain is routing, not an engine's speed or health: any engine's."""
        if self.engine != "synthetic" and (self.replica_speeds or self.replica_down):
            raise ValueError(
                "--replica-speeds, --replica-down: only with --engine synthetic (another "
                "engine's speed and health are its own)"
            )
        return {
            "speeds": argtypes.replica_speeds(self.replica_speeds),
            "down": argtypes.replica_downs(self.replica_down),
            "drain": argtypes.replica_drains(self.replica_drain),
        }

    # ------------------------------------------------------------ the command line

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field. Every default is None (False for a switch): :meth:`from_args`
        tells given from not."""
        for f in fields(cls):
            m = f.metadata
            if _kind(f) is bool:
                parser.add_argument(_flag(f.name), action="store_true", help=m["help"])
            elif m["many"]:
                parser.add_argument(
                    _flag(f.name), action="append", metavar=m["metavar"], help=m["help"]
                )
            else:
                parser.add_argument(
                    _flag(f.name),
                    type=m["type"],
                    choices=m["choices"],
                    metavar=m["metavar"],
                    help=m["help"],
                )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServeOptions":
        """The options given on the command line, defaults for the rest; ValueError naming the
        flag when bad."""
        given = {
            f.name: getattr(args, f.name)
            for f in fields(cls)
            # 0 is given
            if getattr(args, f.name) is not None and getattr(args, f.name) is not False
        }
        given.update(
            {
                name: ",".join(given[name])
                for name in given
                if cls.__dataclass_fields__[name].metadata["many"]
            }
        )
        engine = given.get("engine", cls.engine)
        wrong = [
            f for f in fields(cls) if f.metadata["engine"] not in (None, engine) and f.name in given
        ]
        if wrong:
            flags = ", ".join(_flag(f.name) for f in wrong)
            raise ValueError(f"{flags}: only with --engine {wrong[0].metadata['engine']}")
        options = cls(**given)
        for name, (other, why) in options._unmet_needs():
            raise ValueError(f"{_flag(name)}: only with {_flag(other)} ({why})")
        for f in options._missing():
            raise ValueError(f"--engine {engine} needs {_flag(f.name)} {f.metadata['metavar']}")
        # a parameter the policy does not have is refused before anything starts
        options.make_policy()
        for f in fields(cls):
            if f.metadata["check"] and f.name in given:
                f.metadata["check"](given[f.name])
        options.engine_model()
        options.fleet()
        return options

    def argv(self) -> list[str]:
        """A child process's command line: ``python -m experiments serve`` and every flag whose
        value is not the default, engine-specific ones only for the engine that takes them."""
        flags = []
        for f in fields(self):
            value = getattr(self, f.name)
            if (
                value == f.default
                or f.metadata["engine"] not in (None, self.engine)
                or f.metadata["secret"]
            ):
                continue
            flags += [_flag(f.name)] if value is True else [_flag(f.name), str(value)]
        return [sys.executable, "-m", "experiments", "serve", *flags]

    # ------------------------------------------------------------ a [server] table

    @classmethod
    def toml_kinds(cls) -> dict[str, type]:
        """The ``[server]`` keys that are serve options, and the TOML type of each."""
        return {f.name: _kind(f) for f in fields(cls) if f.metadata["toml"]}

    @classmethod
    def from_table(cls, where: str, table: dict) -> "ServeOptions":
        """Options from ``[server]`` values already of their kinds (:meth:`toml_kinds`); ConfigError
        naming the key.

        ``where`` is the table's name in messages, e.g. ``live.toml: server``.
        """
        for name, value in table.items():
            m = cls.__dataclass_fields__[name].metadata
            problem = None
            if m["choices"] and value not in m["choices"]:
                problem = (
                    f"must be {', '.join(m['choices'][:-1])} or {m['choices'][-1]}, got {value!r}"
                )
            elif isinstance(m["type"], argtypes.Number) and m["type"].out_of_range(value):
                problem = f"{m['type'].out_of_range(value)}, got {value!r}"
            elif m["check"]:
                try:
                    m["check"](value)
                except ValueError as exc:
                    problem = str(exc)
            if problem:
                raise ConfigError(f"{where}.{name}: {problem}")
        options = cls(**table)
        for name, (other, why) in options._unmet_needs():
            raise ConfigError(f"{where}.{name}: only with {other} ({why})")
        for f in options._missing():
            raise ConfigError(f"{where}.{f.name}: required with engine = {options.engine!r}")
        try:
            options.engine_model()
            options.fleet()
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        return options

    def _missing(self) -> list:
        """The fields this engine requires that are not set."""
        return [
            f
            for f in fields(self)
            if f.metadata["required"]
            and f.metadata["engine"] == self.engine
            and getattr(self, f.name) is None
        ]

    def _unmet_needs(self) -> list[tuple[str, tuple[str, str]]]:
        return [
            (f.name, f.metadata["needs"])
            for f in fields(self)
            if f.metadata["needs"]
            and getattr(self, f.name) is not None
            and getattr(self, f.metadata["needs"][0]) is None
        ]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _kind(f) -> type:
    """A field's value type, without the None of an optional one."""
    hint = typing.get_type_hints(ServeOptions)[f.name]
    if isinstance(hint, types.UnionType):
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint

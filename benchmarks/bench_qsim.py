"""How fast does qlab's simulator run, next to plain SimPy and ciw?

Measures simulated requests per wall-clock second, all in one run, for four cases:

* Case A: M/M/1 at rho 0.9 (Poisson arrivals, exponential service of mean 1 s),
  no admission control.
* Case B: the ``predictive`` policy at load 2 on the reference mix
  (max_new_tokens 4/16/64 with probabilities 0.5/0.35/0.15, service
  0.001 + 0.0085 * tokens seconds, deadline 2 s).
* Cases C and D: case B with the queue kept in a heap: earliest deadline first
  (``predictive-edf``) and two non-preemptive priority classes (30 % high). Their
  plain SimPy row is case B's FIFO model: a heap must not cost qlab its lead. No ciw rows.

Each case is run by three implementations:

1. qlab: ``qsim.simulate`` on a ``qsim.make_trace`` trace. The timing includes
   building the per-request DataFrame, since qlab always records every request.
   Generating the trace is not timed.
2. plain SimPy: the simplest honest model with ``simpy.Resource(capacity=1)``
   and one process per customer, fed the *same* arrival and service times, and
   recording every request's wait (and, in case B, its rejection) into
   preallocated lists. In case B it applies the same predictive rule at arrival.
3. ciw: a ``ciw`` network of the same distributions; ciw draws its own random
   numbers. Case B has no ciw equivalent of predictive admission, so ciw runs
   the nearest built-in: the same M/G/1 with a waiting room of 13
   (deadline 2 s / mean service 0.147 s).

Each figure is the best of ``--repeat`` runs in this process's CPU time (time.process_time:
on a shared machine, wall time swung +-40 % between two runs; CPU time does not count the
other processes' turns). Below the table
an untimed check compares what the models computed (mean wait, rejected share),
so a fast but wrong model would show.

Run from the repository root::

    PYTHONPATH=. python benchmarks/bench_qsim.py            # 200,000 requests, best of 3
    PYTHONPATH=. python benchmarks/bench_qsim.py --quick    # 20,000 requests, 1 run (smoke test)
    PYTHONPATH=. python benchmarks/bench_qsim.py --json     # the results as JSON

Other flags: --requests N, --repeat R, --ciw-requests N (run ciw on fewer requests;
requests/s stays comparable), --no-ciw.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from dataclasses import dataclass, field, replace

import numpy as np
import simpy

from qsim import REFERENCE_MIX, Policy, ServiceModel, make_trace, preset, simulate

try:  # ciw is an optional (bench) dependency; without it the ciw rows are skipped.
    import ciw
except ImportError:  # pragma: no cover - depends on the environment
    ciw = None

# qlab's own targets (ratios measured in the same run): M/M/1 at rho 0.9 with every request
# recorded at least 1.9x plain SimPy and 4x ciw; predictive at least as fast as plain SimPy.
# Disciplines that need a heap (C: EDF, D: two priority classes) at least at plain SimPy's speed
# (its model stays the FIFO predictive one of case B: the baseline a heap must not fall behind).
TARGETS = {
    "A": {"plain SimPy": 1.9, "ciw": 4.0},
    "B": {"plain SimPy": 1.0, "ciw": 2.0},
    "C": {"plain SimPy": 1.0},
    "D": {"plain SimPy": 1.0},
}
CIW_QUEUE_CAPACITY = 13  # ~ deadline 2 s / mean reference-mix service 0.147 s


@dataclass
class Case:
    """One benchmark case: how to make its trace and which qlab policy to run."""

    key: str
    title: str
    trace_kwargs: dict
    policy: Policy
    classes: bool = False  # draw two priority classes (30 % high) for the requests


@dataclass
class Row:
    """One timed implementation of one case."""

    case: str
    impl: str
    requests: int
    seconds: float
    check: dict = field(default_factory=dict)  # untimed sanity numbers
    note: str = ""

    @property
    def rate(self) -> float:
        return self.requests / self.seconds


def cases(n: int) -> list[Case]:
    a = dict(
        arrivals="poisson", service="exponential", load=0.9, requests=n, seed=1, mean_service_s=1.0
    )
    b = dict(arrivals="poisson", service="mix", load=2.0, requests=n, seed=1)
    return [
        Case("A", "M/M/1 rho 0.9", a, preset("none")),
        Case("B", "predictive, load 2, reference mix", b, preset("predictive")),
        Case("C", "predictive-edf, load 2, reference mix", b, preset("predictive-edf")),
        Case(
            "D",
            "predictive, priority classes, load 2",
            b,
            replace(preset("predictive"), discipline="priority"),
            classes=True,
        ),
    ]


# ------------------------------------------------------------------ timing


def best_of(repeat: int, fn, *args):
    """Best wall time of ``repeat`` calls and the last call's result.

    Best-of rather than mean: the noise on a quiet machine only ever adds time.
    A collection before each run keeps garbage left by the previous run from
    being charged to this one.
    """
    best, result = math.inf, None
    for _ in range(repeat):
        result = None
        gc.collect()
        t0 = time.process_time()
        result = fn(*args)
        best = min(best, time.process_time() - t0)
    return best, result


# ------------------------------------------------------------------ qlab


def run_qlab(trace, policy, priority=None):
    # simulate() returns the full per-request frame, so its construction is timed too.
    return simulate(trace, policy, priority=priority)


def qlab_check(frame) -> dict:
    served = frame["start_s"].notna()
    wait = (frame["start_s"] - frame["arrival_s"])[served]
    return {
        "mean_wait_s": float(wait.mean()),
        "rejected_share": float((frame["outcome"] == "rejected").mean()),
    }


# ------------------------------------------------------------------ plain SimPy


def run_simpy_fifo(arrival_s: np.ndarray, service_s: np.ndarray) -> list:
    """Case A: one Resource, one process per customer; returns each request's wait."""
    env = simpy.Environment()
    res = simpy.Resource(env, capacity=1)
    # Lists, as qlab uses: scalar access is much faster than on numpy arrays.
    arrival, service = arrival_s.tolist(), service_s.tolist()
    waits = [math.nan] * len(arrival)

    def customer(i, s):
        with res.request() as req:
            yield req
            waits[i] = env.now - arrival[i]
            yield env.timeout(s)

    def source():
        for i, t in enumerate(arrival):
            yield env.timeout(t - env.now)
            env.process(customer(i, service[i]))

    env.process(source())
    env.run()
    return waits


def run_simpy_predictive(arrival_s, true_s, est_s, deadline_s: float):
    """Case B: as case A plus the predictive rule at arrival; returns (waits, rejected).

    Admission is decided in the source, synchronously at the arrival instant,
    from the estimated work of those admitted but not yet started plus the
    estimated remaining work of the one in service (``busy_until - now``,
    clamped at 0 when the server is idle). Rejected when wait + own estimate
    > deadline. Estimates are exact in this trace, so qlab's second line
    (expiry at the front) never fires and is left out here.
    """
    env = simpy.Environment()
    res = simpy.Resource(env, capacity=1)
    arrival, true, est = arrival_s.tolist(), true_s.tolist(), est_s.tolist()
    n = len(arrival)
    waits, rejected = [math.nan] * n, [False] * n
    state = {"queued_est": 0.0, "busy_until": 0.0}  # shared by source and customers

    def customer(i):
        with res.request() as req:
            yield req
            now = env.now
            waits[i] = now - arrival[i]
            state["queued_est"] -= est[i]
            state["busy_until"] = now + est[i]
            yield env.timeout(true[i])

    def source():
        for i, t in enumerate(arrival):
            yield env.timeout(t - env.now)
            wait = state["queued_est"] + max(0.0, state["busy_until"] - env.now)
            if wait + est[i] > deadline_s:
                rejected[i] = True
                continue
            state["queued_est"] += est[i]
            env.process(customer(i))

    env.process(source())
    env.run()
    return waits, rejected


def simpy_check(waits, rejected=None) -> dict:
    w = np.asarray(waits)
    share = float(np.mean(rejected)) if rejected is not None else 0.0
    return {"mean_wait_s": float(np.nanmean(w)), "rejected_share": share}


def run_plain(case: Case, trace):
    if case.policy.predictive:
        return run_simpy_predictive(
            trace.arrival_s, trace.true_service_s, trace.est_service_s, case.policy.deadline_s
        )
    return run_simpy_fifo(trace.arrival_s, trace.true_service_s), None


# ------------------------------------------------------------------ ciw


def ciw_network(case: Case, trace):
    """The ciw network of the case's distributions (ciw samples its own numbers)."""
    rate = trace.meta["rate"]  # the arrival rate the trace was generated with
    arrivals = [ciw.dists.Exponential(rate=rate)]
    if case.key == "A":
        return ciw.create_network(
            arrival_distributions=arrivals,
            service_distributions=[ciw.dists.Exponential(rate=1.0 / trace.meta["mean_service_s"])],
            number_of_servers=[1],
        )
    # No predictive admission in ciw: the closest built-in is a bounded waiting room.
    times = ServiceModel().estimate(REFERENCE_MIX.sizes).tolist()
    return ciw.create_network(
        arrival_distributions=arrivals,
        service_distributions=[ciw.dists.Pmf(times, list(REFERENCE_MIX.probs))],
        number_of_servers=[1],
        queue_capacities=[CIW_QUEUE_CAPACITY],
    )


def run_ciw(network, n: int):
    # Seeded each run so every repeat simulates the same sample path.
    ciw.seed(1)
    sim = ciw.Simulation(network)
    sim.simulate_until_max_customers(n, method="Arrive")
    return sim.get_all_records()  # every request's record, as qlab and plain SimPy keep


def ciw_check(records) -> dict:
    served = [r.waiting_time for r in records if r.record_type == "service"]
    rejected = sum(r.record_type == "rejection" for r in records)
    return {"mean_wait_s": float(np.mean(served)), "rejected_share": rejected / len(records)}


# ------------------------------------------------------------------ driver


def bench_case(case: Case, args) -> list[Row]:
    trace = make_trace(**case.trace_kwargs)  # not timed
    n = len(trace)
    rows = []
    priority = (np.random.default_rng(7).random(n) < 0.3).astype(int) if case.classes else None
    sec, frame = best_of(args.repeat, run_qlab, trace, case.policy, priority)
    rows.append(Row(case.key, "qlab", n, sec, qlab_check(frame)))
    del frame
    sec, (waits, rejected) = best_of(args.repeat, run_plain, case, trace)
    rows.append(Row(case.key, "plain SimPy", n, sec, simpy_check(waits, rejected)))
    del waits, rejected
    if ciw is not None and not args.no_ciw and "ciw" in TARGETS[case.key]:
        m = min(n, args.ciw_requests or n)
        sec, records = best_of(args.repeat, run_ciw, ciw_network(case, trace), m)
        rows.append(Row(case.key, "ciw", m, sec, ciw_check(records), ciw_note(case, m, n)))
    return rows


def ciw_note(case: Case, m: int, n: int) -> str:
    note = "ciw draws its own random numbers from the same distributions"
    if case.key == "B":
        note += (
            "; closest ciw equivalent, not identical: M/G/1 with "
            f"queue_capacities=[{CIW_QUEUE_CAPACITY}], no predictive admission"
        )
    if m < n:
        note += f"; run on {m:,} requests (requests/s is the metric)"
    return note


def ratio(rows: list[Row], case: str, impl: str) -> float | None:
    by = {r.impl: r for r in rows if r.case == case}
    if impl not in by:
        return None
    return by["qlab"].rate / by[impl].rate


def print_table(rows: list[Row], all_cases: list[Case], args) -> None:
    head = (
        f"{'case':<5}| {'implementation':<15}| {'requests':>9} | {'seconds':>8} | "
        f"{'requests/s':>11} | ratio qlab/this"
    )
    print(
        f"qlab simulator benchmark: best of {args.repeat} run(s), CPU time (time.process_time), "
        f"Python {sys.version.split()[0]}"
    )
    for c in all_cases:
        print(f"  Case {c.key}: {c.title}")
    print()
    print(head)
    print("-" * len(head))
    for r in rows:
        q = ratio(rows, r.case, r.impl)
        print(
            f"{r.case:<5}| {r.impl:<15}| {r.requests:>9,} | {r.seconds:>8.3f} | "
            f"{r.rate:>11,.0f} | {q:.2f}x"
        )
    print("\nUntimed check of what each model computed (qlab and plain SimPy see the same trace):")
    for r in rows:
        print(
            f"  {r.case} {r.impl:<12} mean wait {r.check['mean_wait_s']:.4f} s, rejected "
            f"{r.check['rejected_share']:.4f}"
        )
    notes = sorted({f"  Case {r.case} ciw: {r.note}" for r in rows if r.note})
    if notes:
        print("\nNotes:")
        print("\n".join(notes))
    if ciw is None and not args.no_ciw:
        print("\nNote: `import ciw` failed, ciw rows skipped (pip install ciw).")
    print()
    for c in all_cases:
        for impl, label in (("plain SimPy", "plain SimPy"), ("ciw", "ciw")):
            if impl not in TARGETS[c.key]:
                continue
            target = TARGETS[c.key][impl]
            q = ratio(rows, c.key, impl)
            if q is None:
                print(f"Case {c.key}  qlab vs {label}: skipped (target >= {target:.1f})")
            else:
                verdict = "met" if q >= target else "NOT met"
                print(f"Case {c.key}  qlab vs {label}: {q:.2f}x (target >= {target:.1f}) {verdict}")


def to_json(rows: list[Row], args) -> str:
    out = {
        "repeat": args.repeat,
        "ciw_available": ciw is not None,
        "rows": [
            dict(
                case=r.case,
                implementation=r.impl,
                requests=r.requests,
                seconds=r.seconds,
                requests_per_s=r.rate,
                ratio_qlab_over_this=ratio(rows, r.case, r.impl),
                check=r.check,
                note=r.note,
            )
            for r in rows
        ],
    }
    return json.dumps(out, indent=2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--requests", type=int, default=200_000, help="requests per case (default 200000)"
    )
    p.add_argument(
        "--repeat", type=int, default=3, help="runs per measurement, best kept (default 3)"
    )
    p.add_argument(
        "--ciw-requests", type=int, default=None, help="run ciw on at most this many requests"
    )
    p.add_argument("--quick", action="store_true", help="smoke test: 20000 requests, 1 run")
    p.add_argument("--no-ciw", action="store_true", help="skip ciw")
    p.add_argument(
        "--json", action="store_true", help="print the results as JSON instead of a table"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.repeat = 20_000, 1
    if args.requests < 1 or args.repeat < 1:
        p.error("--requests and --repeat must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    all_cases = cases(args.requests)
    # Untimed warm-up of every implementation on a tiny trace: first calls pay one-time
    # costs (lazy imports, pandas initialisation) that would otherwise land on whichever
    # row runs first, which matters with --quick's single run.
    warm = argparse.Namespace(**{**vars(args), "repeat": 1, "ciw_requests": None})
    for c in cases(500):
        bench_case(c, warm)
    rows = [row for c in all_cases for row in bench_case(c, args)]
    if args.json:
        print(to_json(rows, args))
    else:
        print_table(rows, all_cases, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

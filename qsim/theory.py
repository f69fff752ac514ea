"""Closed forms for the queues qsim models, computed stably with numpy and scipy.

Conventions: lam is the arrival rate, mu the service rate of one engine, c the
number of engines, K the most requests in the system (waiting + in service).
Wq / W: mean wait / time in system; Lq / L: mean number waiting / in system.
Probabilities of the M/M/c/K family are computed in log space (gammaln and
logsumexp), so c and K in the thousands neither overflow nor lose precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import linalg, optimize, stats
from scipy.special import gammaln, logsumexp


@dataclass(frozen=True)
class Queue:
    """Steady-state means of a queue; p_wait and p_block where they apply."""

    wq: float
    w: float
    lq: float
    l: float  # noqa: E741 - the textbook name
    p_wait: float = math.nan
    p_block: float = 0.0


def _check_rates(lam: float, mu: float, c: int = 1) -> None:
    if not (lam > 0 and mu > 0 and math.isfinite(lam) and math.isfinite(mu)):
        raise ValueError(f"rates must be positive and finite, got lam={lam}, mu={mu}")
    if c < 1 or int(c) != c:
        raise ValueError(f"the number of engines must be a whole number >= 1, got {c}")


def _stable(lam: float, mu: float, c: int = 1) -> None:
    _check_rates(lam, mu, c)
    if lam >= c * mu:
        raise ValueError(f"unstable: utilisation {lam / (c * mu):.3f} >= 1 has no steady state")


def mm1(lam: float, mu: float) -> Queue:
    """M/M/1: Wq = rho / (mu - lam)."""
    _stable(lam, mu)
    rho = lam / mu
    wq = rho / (mu - lam)
    return Queue(wq=wq, w=wq + 1 / mu, lq=lam * wq, l=lam * (wq + 1 / mu), p_wait=rho)


def mm1_wait_tail(lam: float, mu: float, t: float) -> float:
    """M/M/1: P(wait > t) = rho exp(-(mu - lam) t)."""
    _stable(lam, mu)
    return lam / mu * math.exp(-(mu - lam) * t)


def mg1(lam: float, mean_s: float, second_moment_s: float) -> Queue:
    """M/G/1 by Pollaczek-Khinchine: Wq = lam E[S^2] / (2 (1 - rho))."""
    _stable(lam, 1 / mean_s)
    rho = lam * mean_s
    wq = lam * second_moment_s / (2 * (1 - rho))
    return Queue(wq=wq, w=wq + mean_s, lq=lam * wq, l=lam * (wq + mean_s), p_wait=rho)


def md1(lam: float, d: float) -> Queue:
    """M/D/1: P-K with E[S^2] = d^2, so Wq = rho d / (2 (1 - rho))."""
    return mg1(lam, d, d * d)


def _mmck_log_weights(a: float, c: int, K: int) -> np.ndarray:
    """Unnormalised log P(n in system), n = 0..K, for offered load a = lam / mu."""
    n = np.arange(K + 1)
    low = n * math.log(a) - gammaln(n + 1)  # a^n / n!            for n <= c
    high = c * math.log(a) - gammaln(c + 1) + (n - c) * math.log(a / c)  # a^c/c! (a/c)^(n-c)
    return np.where(n <= c, low, high)


def mmck(lam: float, mu: float, c: int, K: int) -> Queue:
    """M/M/c/K: c engines, at most K in the system (K - c waiting); any load."""
    _check_rates(lam, mu, c)
    if K < c or int(K) != K:
        raise ValueError(f"K (most in system) must be a whole number >= c = {c}, got {K}")
    logw = _mmck_log_weights(lam / mu, c, K)
    p = np.exp(logw - logsumexp(logw))
    n = np.arange(K + 1)
    lq = float(np.dot(np.maximum(n - c, 0), p))
    length = float(np.dot(n, p))
    p_block = float(p[K])
    lam_eff = lam * (1 - p_block)
    # PASTA: an arrival finds n with probability p[n]; it waits if it is admitted and all c are
    # busy.
    p_wait = float(p[c:K].sum() / (1 - p_block)) if K > c else 0.0
    return Queue(
        wq=lq / lam_eff, w=length / lam_eff, lq=lq, l=length, p_wait=p_wait, p_block=p_block
    )


def mm1k(lam: float, mu: float, K: int) -> Queue:
    """M/M/1/K: P_block = (1 - rho) rho^K / (1 - rho^(K+1)), 1 / (K + 1) at rho = 1."""
    return mmck(lam, mu, 1, K)


def erlang_b(c: int, a: float) -> float:
    """M/M/c/c blocking probability for offered load a (Erlangs).

    The recursion B(n) = a B(n-1) / (n + a B(n-1)) stays in [0, 1], so it is
    stable for any c, unlike a^c / c! summed directly.
    """
    if c < 0 or int(c) != c or not a >= 0:
        raise ValueError(f"Erlang B needs c >= 0 whole and a >= 0, got c={c}, a={a}")
    b = 1.0
    for n in range(1, int(c) + 1):
        b = a * b / (n + a * b)
    return b


def erlang_c(c: int, a: float) -> float:
    """M/M/c probability that an arrival waits (Erlang C), from Erlang B."""
    if not 0 <= a < c:
        raise ValueError(f"Erlang C needs 0 <= a < c (a stable queue), got a={a}, c={c}")
    b = erlang_b(c, a)
    rho = a / c
    return b / (1 - rho * (1 - b))


def mmc(lam: float, mu: float, c: int) -> Queue:
    """M/M/c: P(wait) by Erlang C, Wq = C / (c mu - lam)."""
    _stable(lam, mu, c)
    p_wait = erlang_c(c, lam / mu)
    wq = p_wait / (c * mu - lam)
    return Queue(wq=wq, w=wq + 1 / mu, lq=lam * wq, l=lam * (wq + 1 / mu), p_wait=p_wait)


def mmc_wait_tail(lam: float, mu: float, c: int, t: float) -> float:
    """M/M/c: P(wait > t) = C exp(-(c mu - lam) t)."""
    return mmc(lam, mu, c).p_wait * math.exp(-(c * mu - lam) * t)


def priority_mg1(lams, means_s, second_moments_s) -> list[float]:
    """Mean wait of each class of a non-preemptive priority M/G/1, highest priority first (Cobham,
    1954).

    W0 = sum(lam_i E[S_i^2]) / 2 is the expected residual work found in service;
    Wq_k = W0 / ((1 - sigma_{k-1}) (1 - sigma_k)) with sigma_k the load of classes 1..k.
    Shortest job first over a few job sizes is this with the classes ordered by size.
    """
    lams, means, m2 = (np.asarray(v, dtype=float) for v in (lams, means_s, second_moments_s))
    rho = lams * means
    if np.any(lams < 0) or not rho.sum() < 1:
        raise ValueError(f"priority M/G/1 needs total load below 1, got {rho.sum():g}")
    w0 = float(np.dot(lams, m2)) / 2
    sigma = np.concatenate([[0.0], np.cumsum(rho)])
    return [float(w0 / ((1 - sigma[k]) * (1 - sigma[k + 1]))) for k in range(len(lams))]


@dataclass(frozen=True)
class Impatient:
    """Steady state of a queue whose waiting customers may abandon.

    p_wait: an arrival finds every engine busy (PASTA); p_abandon: it leaves unserved;
    wq / lq: mean wait and mean number waiting over *all* arrivals, an abandoning one
    counting its time in the queue until it left (so wq = lq / lam by Little).
    """

    p_wait: float
    p_abandon: float
    wq: float
    lq: float


#: Erlang A's chain is cut where the tail weighs under exp(-TAIL_LOG) of its largest state.
TAIL_LOG = 40.0


def erlang_a(lam: float, mu: float, c: int, theta: float) -> Impatient:
    """M/M/c+M (Erlang A): c engines, waiting customers abandon at rate theta (mean patience 1 /
    theta).

    The patience runs while waiting only: a customer in service stays. The birth-death
    chain has birth rate lam and death rate min(n, c) mu + max(n - c, 0) theta in state n;
    it is stable at any load, since the abandonment rate grows with the queue. It is
    solved in log space and truncated at the first state N past which every ratio
    lam / death is below 1/2 and whose weight is under exp(-40) of the largest: the
    tail beyond N then weighs less than that bound (a geometric series of ratio 1/2),
    far below double precision. P(wait) = P(N >= c), P(abandon) = theta Lq / lam
    (abandonments per unit time over arrivals), Wq = Lq / lam.
    """
    _check_rates(lam, mu, c)
    if not (theta > 0 and math.isfinite(theta)):
        raise ValueError(
            f"the abandonment rate theta must be positive and finite, got {theta} "
            "(theta = 0 is M/M/c: use mmc)"
        )

    def log_weights(top: int) -> np.ndarray:
        n = np.arange(1, top + 1)
        death = np.minimum(n, c) * mu + np.maximum(n - c, 0) * theta
        return np.concatenate([[0.0], np.cumsum(np.log(lam / death))])

    # From `half` on, every ratio is below 1/2, so each step lowers the log weight by at least log
    # 2.
    half = c + max(0, math.ceil((2 * lam - c * mu) / theta) + 1)
    logw = log_weights(half)
    extra = math.ceil((logw[-1] - logw.max() + TAIL_LOG) / math.log(2)) + 1
    logw = log_weights(half + max(extra, 0))
    p = np.exp(logw - logsumexp(logw))
    waiting = np.maximum(np.arange(len(p)) - c, 0)
    lq = float(np.dot(waiting, p))
    return Impatient(p_wait=float(p[c:].sum()), p_abandon=theta * lq / lam, wq=lq / lam, lq=lq)


def mmc_deterministic_patience(lam: float, mu: float, c: int, tau: float) -> float:
    """M/M/c+D, FIFO: the probability of abandoning when every customer waits at most tau.

    P(abandon) = (1 - rho) q / (1 - rho q), q = C(c, a) exp(-(c mu - lam) tau), with
    rho = lam / (c mu), a = lam / mu and C Erlang C (the M/M/c probability of waiting).
    tau = 0 gives Erlang B; tau -> infinity gives 0. Only for rho < 1, where Erlang C exists
    (the system itself is stable at any load).
    """
    _stable(lam, mu, c)
    if not tau >= 0:
        raise ValueError(f"patience tau must be >= 0, got {tau}")
    rho = lam / (c * mu)
    q = erlang_c(c, lam / mu) * math.exp(-(c * mu - lam) * tau)
    return (1 - rho) * q / (1 - rho * q)


# ---------------------------------------------------------------- engines that share


def mg1_ps(lam: float, mean_s: float) -> Queue:
    """M/G/1 processor sharing (M/M/1-PS included): W = E[S] / (1 - rho), L = rho / (1 - rho).

    Every request present gets an equal share of the engine, so nobody waits (wq = lq = 0,
    p_wait = 0) and the mean time in system depends on the size distribution through its
    mean only (insensitivity; Kleinrock 1967, Sakata-Noguchi-Oizumi 1971): E[T | S = x] =
    x / (1 - rho) for every x.
    """
    _stable(lam, 1 / mean_s)
    rho = lam * mean_s
    w = mean_s / (1 - rho)
    return Queue(wq=0.0, w=w, lq=0.0, l=lam * w, p_wait=0.0)


def _check_batching(lam: float, step_s: float, per_seq_s: float, mean_tokens: float) -> None:
    if not (lam > 0 and math.isfinite(lam)):
        raise ValueError(f"the arrival rate must be positive and finite, got {lam}")
    if not (
        step_s >= 0
        and per_seq_s >= 0
        and step_s + per_seq_s > 0
        and math.isfinite(step_s)
        and math.isfinite(per_seq_s)
    ):
        raise ValueError(
            "a step takes a + b n seconds with a, b >= 0 and a + b > 0, got "
            f"a={step_s}, b={per_seq_s}"
        )
    if not (mean_tokens >= 1 and math.isfinite(mean_tokens)):
        raise ValueError(f"the mean output length is at least 1 token, got {mean_tokens}")


def continuous_batching(lam: float, step_s: float, per_seq_s: float, mean_tokens: float) -> Queue:
    """Continuous batching as state-dependent processor sharing: W = E[L] (a + b) / (1 - lam E[L]
    b).

    Every request present runs (no cap on the batch); a step with n sequences takes
    a + b n seconds (``step_s`` = a, ``per_seq_s`` = b) and gives each of them one token;
    output lengths are geometric with mean E[L] (``mean_tokens``), so each sequence ends
    at a step's end with probability 1 / E[L]; no prompt cost. In continuous time that is a
    birth-death chain on the number present: births lam, deaths at n present
    mu_n = n / (E[L] (a + b n)) (n sequences, each ending at rate 1 / (E[L] x step time)).
    With c = lam E[L] b and r = a / b, its stationary weights are
    prod_{k<=n} lam / mu_k = prod_{k<=n} c (r + k) / k = c^n (r + 1)_n / n!,
    a negative binomial: P(N = n) = C(n + r, n) (1 - c)^(r + 1) c^n, of mean (r + 1) c / (1 - c)
    (scipy.stats.nbinom(r + 1, 1 - c)); stable while c < 1. By Little,
    W = E[N] / lam = E[L] (a + b) / (1 - c). With a = 0 it is PS of E[S] = E[L] b
    (:func:`mg1_ps`); with b = 0 it is M/M/inf of mean E[L] a. Nobody waits (wq = lq = 0).
    """
    _check_batching(lam, step_s, per_seq_s, mean_tokens)
    c = lam * mean_tokens * per_seq_s
    if c >= 1:
        raise ValueError(f"unstable: lam E[L] b = {c:.3f} >= 1 has no steady state")
    w = mean_tokens * (step_s + per_seq_s) / (1 - c)
    return Queue(wq=0.0, w=w, lq=0.0, l=lam * w, p_wait=0.0)


def continuous_batching_capped(
    lam: float, step_s: float, per_seq_s: float, mean_tokens: float, max_running: int
) -> Queue:
    """:func:`continuous_batching` with at most K (``max_running``) in the batch and a FIFO line
    behind.

    The birth-death chain on the number present n has births lam and deaths
    mu_n = m / (E[L] (a + b m)), m = min(n, K) running. Its weights up to K are the
    products of lam / mu_k (in log space); beyond K the death rate stays mu_K, so the tail
    is geometric of ratio s = lam / mu_K and is summed in closed form:
    sum_{j>=1} w_K s^j = w_K s / (1 - s), sum_{j>=1} j w_K s^j = w_K s / (1 - s)^2.
    Stable while s < 1 (lam E[L] (a + b K) < K). Lq: mean number in the line (n - K)^+;
    Wq = Lq / lam, W = L / lam (Little); p_wait = P(N >= K), an arrival finding every seat
    taken (PASTA).
    """
    _check_batching(lam, step_s, per_seq_s, mean_tokens)
    if not (isinstance(max_running, (int, np.integer)) and max_running >= 1):
        raise ValueError(f"the most running K must be a whole number >= 1, got {max_running}")
    k = np.arange(1, max_running + 1)
    death = k / (mean_tokens * (step_s + per_seq_s * k))
    s = float(lam / death[-1])
    if s >= 1:
        raise ValueError(f"unstable: lam E[L] (a + b K) / K = {s:.3f} >= 1 has no steady state")
    logw = np.concatenate([[0.0], np.cumsum(np.log(lam / death))])  # n = 0..K
    tail = logw[-1] + math.log(s / (1 - s))  # log of the tail's total weight, n > K
    log_z = logsumexp(np.append(logw, tail))
    p = np.exp(logw - log_z)
    tail_p = math.exp(tail - log_z)
    lq = tail_p / (1 - s)  # sum_{j>=1} j w_K s^j over the total
    length = float(np.dot(np.arange(max_running + 1), p)) + max_running * tail_p + lq
    return Queue(wq=lq / lam, w=length / lam, lq=lq, l=length, p_wait=float(p[-1]) + tail_p)


def bulk_service_root(lam: float, mu: float, K: int) -> float:
    """The root r0 in (0, 1) of mu z^(K+1) - (lam + mu) z + lam = 0 (Bailey 1954), by scipy's
    brentq.

    f(z) = mu z^(K+1) - (lam + mu) z + lam is convex on z > 0 with f(0) = lam > 0 and
    f(1) = 0; when the queue is stable (lam < K mu) f'(1) = K mu - lam > 0, so f dips below 0
    before 1, at its minimum z* = ((lam + mu) / ((K + 1) mu))^(1/K) < 1: the root lies in (0, z*).
    """
    _check_rates(lam, mu)
    if not (isinstance(K, (int, np.integer)) and K >= 1):
        raise ValueError(f"the batch size K must be a whole number >= 1, got {K}")
    if lam >= K * mu:
        raise ValueError(
            f"unstable: utilisation lam / (K mu) = {lam / (K * mu):.3f} >= 1 has no steady state"
        )
    z_min = ((lam + mu) / ((K + 1) * mu)) ** (1 / K)
    return float(
        optimize.brentq(
            lambda z: mu * z ** (K + 1) - (lam + mu) * z + lam,
            0.0,
            z_min,
            xtol=1e-15,
            rtol=4 * np.finfo(float).eps,
        )
    )


def bulk_service(lam: float, mu: float, K: int) -> Queue:
    """M/M^[K]/1 (Bailey 1954): one server takes up to K waiting customers at once (fewer if fewer
    wait), serves the batch in an exponential time of rate mu whatever its size; arrivals during a
    service wait for the next; an arrival to an idle server starts a batch of one at once.

    States: idle, and busy with n waiting (n >= 0). Balance: lam P_idle = mu p_0 (a batch ends with
    nobody waiting); (lam + mu) p_n = lam p_(n-1) + mu p_(n+K) for n >= 1, solved by p_n = C r0^n
    with r0 = :func:`bulk_service_root`; the n = 0 equation, (lam + mu) p_0 = lam P_idle + mu (p_1 +
    ... + p_K), then holds because mu r0 (1 - r0^K) / (1 - r0) = lam is the characteristic equation
    itself. So the waiting count is geometric of ratio r0 beyond 0; normalising, C = 1 / (1 / (1 -
    r0) + mu / lam). Lq = C r0 / (1 - r0)^2, Wq = Lq / lam (Little), W = Wq + 1 / mu (a batch's
    service does not depend on who is in it), p_wait = 1 - P_idle = 1 - C mu / lam (PASTA: an
    arrival to a busy server waits). (The textbook variant whose server keeps cycling when empty, so
    that every arrival waits for the next service epoch, has p_n = (1 - r0) r0^n for all n >= 0
    instead.) K = 1 is M/M/1 (r0 = rho).
    """
    r0 = bulk_service_root(lam, mu, K)
    c = 1 / (1 / (1 - r0) + mu / lam)
    lq = c * r0 / (1 - r0) ** 2
    wq = lq / lam
    return Queue(wq=wq, w=wq + 1 / mu, lq=lq, l=lam * (wq + 1 / mu), p_wait=1 - c * mu / lam)


def continuous_batching_steps(
    lam: float, step_s: float, per_seq_s: float, mean_tokens: float, max_running: int | None = None
) -> float:
    """Mean time in system of continuous batching as a step-level simulator runs it, solved exactly.

    The model of :func:`continuous_batching` (and, with ``max_running`` K, of
    :func:`continuous_batching_capped`) in discrete steps: a step with m = min(n, K) running takes
    exactly a + b m seconds; each of the m gives one token and ends with it with probability
    1 / E[L]; requests that arrive during a step join at its end (the first K present run, FIFO).
    The number present at a step's start is a Markov chain (survivors + those behind + a Poisson
    number of arrivals in the step); when nobody is left the engine idles 1 / lam on average and the
    next arrival starts a step alone. Its stationary law is solved with scipy on states 1..N, N well
    past where the continuous chain's tail is below 1e-15 (the mass beyond N is kept at N), and
    E[T] = E[N] / lam, E[N] the time average of the number present: a step starting with n holds
    n for its length tau and its arrivals for tau^2 lam / 2 on average.

    It differs from the continuous-time forms by the steps: an arrival waits for the step in flight
    to end, about a / (2 (1 - lam E[L] b)) more in a busy batch, while the per-sequence part b n of
    the step in flight is work done for the others that the continuous chain counts the same way.
    """
    _check_batching(lam, step_s, per_seq_s, mean_tokens)
    if max_running is None:
        c = lam * mean_tokens * per_seq_s
        if c >= 1:
            raise ValueError(f"unstable: lam E[L] b = {c:.3f} >= 1 has no steady state")
        far = (
            stats.poisson.isf(1e-15, lam * mean_tokens * step_s)
            if per_seq_s == 0
            else stats.nbinom.isf(1e-15, step_s / per_seq_s + 1, 1 - c)
        )
        cap = math.inf
    else:
        # checks K, stability
        capped = continuous_batching_capped(lam, step_s, per_seq_s, mean_tokens, max_running)
        s = lam * mean_tokens * (step_s + per_seq_s * max_running) / max_running
        far = max_running + math.log(1e-15) / math.log(s) + capped.l
        cap = max_running
    top = int(1.5 * far) + 30
    n = np.arange(1, top + 1)
    run = np.minimum(n, cap).astype(int)
    tau = step_s + per_seq_s * run
    p_end = 1 / mean_tokens
    moves = np.zeros((top + 1, top + 1))  # from n (row, 1..top) to n' (column, 0..top)
    for i, (k, m, t) in enumerate(zip(n, run, tau), start=1):
        nxt = np.convolve(
            stats.binom.pmf(np.arange(m + 1), m, 1 - p_end),
            stats.poisson.pmf(np.arange(top + 1), lam * t),
        )
        nxt = np.concatenate([np.zeros(k - m), nxt])[: top + 1]
        nxt[-1] += max(0.0, 1.0 - nxt.sum())  # the far tail, kept at the top
        moves[i] = nxt
    # the batch empties after this step: an idle time of mean 1 / lam follows
    idle = moves[1:, 0].copy()
    chain = moves[1:, 1:]
    chain[:, 0] += idle  # ... and the next arrival starts a step alone
    a = chain.T - np.eye(top)
    a[-1] = 1.0  # one balance equation is redundant: replace it by the normalisation
    rhs = np.zeros(top)
    rhs[-1] = 1.0
    pi = linalg.solve(a, rhs)
    held = float(pi @ (n * tau + lam * tau**2 / 2))
    length = float(pi @ (tau + idle / lam))
    return held / length / lam


# ---------------------------------------------------------------- fleets: replicas behind a router


def random_routing(lam: float, mu: float, n: int) -> Queue:
    """N M/M/1 replicas fed a Poisson stream of rate lam, each arrival to a replica drawn
    uniformly: by Poisson thinning each replica is an M/M/1 at lam / N."""
    _check_rates(lam, mu, n)
    return mm1(lam / n, mu)


def gi_m1_root(lst, mu: float) -> float:
    """The root sigma in (0, 1) of sigma = A*(mu (1 - sigma)) of a stable GI/M/1 queue, A* the
    Laplace-Stieltjes transform of its interarrival time (scipy's brentq).

    g(sigma) = A*(mu (1 - sigma)) - sigma is convex (A* is completely monotone) with g(0) > 0 and
    g(1) = 0; stable (rho = 1 / (mu E[T]) < 1), g'(1) = mu E[T] - 1 > 0, so g dips below 0 before
    1, at its minimum, and the root lies between 0 and that minimum."""

    def g(sigma: float) -> float:
        return lst(mu * (1 - sigma)) - sigma

    low = optimize.minimize_scalar(g, bounds=(0.0, 1.0), method="bounded", options={"xatol": 1e-12})
    if not g(low.x) < 0:
        raise ValueError("unstable: the GI/M/1 queue has no root below 1 (utilisation >= 1)")
    return float(optimize.brentq(g, 0.0, low.x, xtol=1e-15, rtol=4 * np.finfo(float).eps))


def round_robin(lam: float, mu: float, n: int) -> Queue:
    """N M/M/1 replicas fed a Poisson stream of rate lam dealt in turn: each replica's
    interarrival is the sum of N exponentials of rate lam (Erlang-N, mean N / lam), so each is an
    E_N/M/1 queue. GI/M/1: an arrival finds n with probability (1 - sigma) sigma^n, sigma the root
    of sigma = (lam / (lam + mu (1 - sigma)))^N (:func:`gi_m1_root`);
    Wq = sigma / (mu (1 - sigma)), W = 1 / (mu (1 - sigma)), p_wait = sigma. N = 1 is M/M/1
    (sigma = rho)."""
    _stable(lam, mu, n)
    sigma = gi_m1_root(lambda s: (lam / (lam + s)) ** n, mu)
    rate = lam / n
    wq, w = sigma / (mu * (1 - sigma)), 1 / (mu * (1 - sigma))
    return Queue(wq=wq, w=w, lq=rate * wq, l=rate * w, p_wait=sigma)


def power_of_d_tail(rho: float, d: int, i: int) -> float:
    """Mean-field fraction of replicas holding at least i requests under the power of d choices
    (Mitzenmacher 1996/2001; Vvedenskaya, Dobrushin and Karpelevich 1996):
    s_i = rho^((d^i-1)/(d-1)) (rho^i for d = 1, the M/M/1 tail)."""
    if d == 1:
        return rho**i
    return rho ** ((d**i - 1) / (d - 1))


def power_of_d(lam: float, mu: float, d: int) -> Queue:
    """The power of d choices in its mean-field limit (N -> infinity): Poisson arrivals of rate
    lam per replica, each sent to the least loaded of d replicas drawn, exponential service of
    rate mu, FIFO at each replica.

    Mitzenmacher's fixed point: the fraction of replicas with at least i requests is
    s_i = rho^((d^i - 1) / (d - 1)), rho = lam / mu (:func:`power_of_d_tail`). The mean number at
    a replica is L = sum_{i>=1} s_i, so by Little W = L / lam =
    (1 / mu) sum_{i>=1} rho^((d^i - d) / (d - 1)) (the exponent (d^i - 1) / (d - 1) - 1); the sum
    converges doubly exponentially and is cut once a term is below 1e-18 of the first. d = 1 is
    M/M/1. A fleet of N replicas differs from this by O(1 / N)."""
    _stable(lam, mu)
    if not (isinstance(d, (int, np.integer)) and d >= 1):
        raise ValueError(f"d must be a whole number >= 1, got {d!r}")
    if d == 1:
        return mm1(lam, mu)
    rho = lam / mu
    length, i = 0.0, 1
    while True:
        s = power_of_d_tail(rho, d, i)
        length += s
        if s < 1e-18 * rho:
            break
        i += 1
    w = length / lam
    wq = w - 1 / mu
    # An arrival waits when all d drawn are busy: s_1^d.
    return Queue(wq=wq, w=w, lq=lam * wq, l=length, p_wait=rho**d)

"""Closed forms against each other and against textbook identities (the simulator checks are in
test_validation)."""

import math

import numpy as np
import pytest

from qsim import theory


def test_mm1():
    q = theory.mm1(0.9, 1.0)
    assert q.wq == pytest.approx(9.0) and q.w == pytest.approx(10.0)
    assert q.lq == pytest.approx(8.1) and q.l == pytest.approx(9.0)
    assert theory.mm1_wait_tail(0.9, 1.0, 0.0) == pytest.approx(0.9)
    assert theory.mm1_wait_tail(0.9, 1.0, 5.0) == pytest.approx(0.9 * math.exp(-0.5))


def test_mm1k_formula_and_rho_one():
    for rho, K in [(0.5, 3), (0.9, 5), (1.5, 10)]:
        expected = (1 - rho) * rho**K / (1 - rho ** (K + 1))
        assert theory.mm1k(rho, 1.0, K).p_block == pytest.approx(expected)
    assert theory.mm1k(1.0, 1.0, 4).p_block == pytest.approx(1 / 5)


def test_mm1k_tends_to_mm1():
    assert theory.mm1k(0.8, 1.0, 400).wq == pytest.approx(theory.mm1(0.8, 1.0).wq, rel=1e-9)


def test_pk_and_md1():
    # Exponential service: E[S^2] = 2 / mu^2, so P-K gives M/M/1.
    assert theory.mg1(0.9, 1.0, 2.0).wq == pytest.approx(theory.mm1(0.9, 1.0).wq)
    # Deterministic service waits half as long.
    assert theory.md1(0.9, 1.0).wq == pytest.approx(theory.mm1(0.9, 1.0).wq / 2)
    # rho E[S] (1 + CV^2) / (2 (1 - rho))
    mean, scv = 0.146, 1.41
    lam = 0.9 / mean
    assert theory.mg1(lam, mean, mean**2 * (1 + scv)).wq == pytest.approx(
        0.9 * mean * (1 + scv) / 0.2
    )


def _erlang_b_factorials(c, a):
    terms = [a**k / math.factorial(k) for k in range(c + 1)]
    return terms[-1] / sum(terms)


@pytest.mark.parametrize("c,a", [(1, 0.5), (2, 1.8), (8, 6.0), (20, 25.0)])
def test_erlang_b_against_the_sum(c, a):
    assert theory.erlang_b(c, a) == pytest.approx(_erlang_b_factorials(c, a))
    assert theory.mmck(a, 1.0, c, c).p_block == pytest.approx(theory.erlang_b(c, a))


def test_erlang_c_against_mmck_with_a_long_queue():
    for c, a in [(1, 0.9), (2, 1.8), (8, 7.6)]:
        q = theory.mmc(a, 1.0, c)
        far = theory.mmck(a, 1.0, c, c + 3000)
        assert q.p_wait == pytest.approx(far.p_wait, rel=1e-6)
        assert q.wq == pytest.approx(far.wq, rel=1e-6)
    assert theory.mmc(0.9, 1.0, 1).p_wait == pytest.approx(0.9)


def test_large_c_is_stable():
    for c in (100, 500, 1000):
        a = 0.95 * c
        b = theory.erlang_b(c, a)
        q = theory.mmc(a, 1.0, c)
        k = theory.mmck(a, 1.0, c, c + 50)
        for x in (b, q.p_wait, q.wq, k.p_block, k.wq):
            assert np.isfinite(x) and x >= 0
        assert theory.mmck(a, 1.0, c, c).p_block == pytest.approx(b, rel=1e-9)
        assert 0 < q.p_wait < 1
    # Heavy overload of a loss system: nearly everything beyond c is blocked.
    assert theory.erlang_b(10, 1000.0) == pytest.approx(1 - 10 / 1000, rel=0.01)


def test_mmc_tail():
    assert theory.mmc_wait_tail(7.6, 1.0, 8, 0.0) == pytest.approx(theory.mmc(7.6, 1.0, 8).p_wait)


@pytest.mark.parametrize(
    "call",
    [
        lambda: theory.mm1(1.0, 1.0),
        lambda: theory.mm1(-1, 1),
        lambda: theory.mmc(2.0, 1.0, 2),
        lambda: theory.mg1(10, 0.1, 0.02),
        lambda: theory.mmck(1, 1, 2, 1),
        lambda: theory.erlang_c(2, 2.0),
        lambda: theory.erlang_b(-1, 1.0),
        lambda: theory.mmc(1, 1, 0),
    ],
)
def test_refuses_what_has_no_answer(call):
    with pytest.raises(ValueError):
        call()


def test_cobham_two_priority_classes():
    # M/M/1, lambda1 = 0.3 (served first), lambda2 = 0.5, mu = 1.
    high, low = theory.priority_mg1([0.3, 0.5], [1.0, 1.0], [2.0, 2.0])
    assert high == pytest.approx(8 / 7) and low == pytest.approx(40 / 7)  # 1.143 and 5.714
    # The conservation law: load-weighted waits equal the FIFO (P-K) wait of the whole stream.
    fifo = theory.mg1(0.8, 1.0, 2.0).wq
    assert (0.3 * high + 0.5 * low) / 0.8 == pytest.approx(fifo)
    # One class is M/G/1 itself.
    assert theory.priority_mg1([0.5], [1.0], [2.0])[0] == pytest.approx(theory.mm1(0.5, 1).wq)
    with pytest.raises(ValueError, match="below 1"):
        theory.priority_mg1([0.6, 0.5], [1.0, 1.0], [2.0, 2.0])


def test_erlang_a_example():
    # lambda 100/30 per minute, mean service 3 min, mean patience 5 min, 14 engines.
    q = theory.erlang_a(100 / 30, 1 / 3, 14, 1 / 5)
    assert round(q.p_wait, 4) == 0.1453
    assert round(q.p_abandon, 5) == 0.01398
    assert round(q.wq, 4) == 0.0699
    assert q.wq == pytest.approx(q.lq / (100 / 30))


def test_erlang_a_identities():
    from scipy.stats import poisson

    # Patience as long as a service (theta = mu): every customer leaves at rate mu, M/M/inf counts.
    a, c = 7.0, 5
    q = theory.erlang_a(a, 1.0, c, 1.0)
    n = np.arange(200)
    p = poisson.pmf(n, a)
    assert q.p_wait == pytest.approx(poisson.sf(c - 1, a), rel=1e-9)
    assert q.lq == pytest.approx(float(np.dot(np.maximum(n - c, 0), p)), rel=1e-9)
    # Nearly infinite patience: Erlang C.
    assert theory.erlang_a(1.8, 1.0, 2, 1e-7).p_wait == pytest.approx(
        theory.mmc(1.8, 1.0, 2).p_wait, rel=1e-4
    )
    # Heavy overload: the engines serve c mu, the rest abandon.
    assert theory.erlang_a(50.0, 1.0, 10, 0.01).p_abandon == pytest.approx(0.8, rel=1e-6)
    # Large c stays finite.
    big = theory.erlang_a(950.0, 1.0, 1000, 0.5)
    assert 0 < big.p_wait < 1 and 0 < big.p_abandon < big.p_wait


def test_mmc_deterministic_patience():
    assert round(theory.mmc_deterministic_patience(0.9, 1.0, 1, 2.0), 4) == 0.2188
    assert round(theory.mmc_deterministic_patience(3.6, 1.0, 4, 1.0), 4) == 0.1006
    # M/M/1: (1 - rho) rho e^{-(mu - lam) tau} / (1 - rho^2 e^{-(mu - lam) tau}).
    e = math.exp(-0.5 * 3.0)
    assert theory.mmc_deterministic_patience(0.5, 1.0, 1, 3.0) == pytest.approx(
        0.5 * 0.5 * e / (1 - 0.25 * e)
    )
    # No patience at all is the loss system (Erlang B); endless patience abandons nobody.
    assert theory.mmc_deterministic_patience(6.0, 1.0, 8, 0.0) == pytest.approx(
        theory.erlang_b(8, 6.0)
    )
    assert theory.mmc_deterministic_patience(6.0, 1.0, 8, 1e3) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    "call",
    [
        lambda: theory.erlang_a(1.0, 1.0, 2, 0.0),
        lambda: theory.erlang_a(1.0, 1.0, 0, 1.0),
        lambda: theory.mmc_deterministic_patience(2.0, 1.0, 2, 1.0),
        lambda: theory.mmc_deterministic_patience(0.5, 1.0, 1, -1.0),
    ],
)
def test_impatience_refuses_what_has_no_answer(call):
    with pytest.raises(ValueError):
        call()


# ---------------------------------------------------------------- engines that share, against brute
# force Each closed form is checked against its continuous-time Markov chain built state by state as
# a truncated generator matrix and solved with scipy (pi Q = 0, sum pi = 1), not against pinned
# numbers.


def _stationary(q) -> np.ndarray:
    """pi with pi Q = 0 and sum(pi) = 1 for a generator Q (rows sum to 0), by scipy's sparse
    solver."""
    from scipy import sparse
    from scipy.sparse.linalg import spsolve

    a = sparse.lil_matrix(sparse.csr_matrix(q).T)
    a[-1, :] = 1.0  # one balance equation is redundant: replace it by the normalisation
    rhs = np.zeros(q.shape[0])
    rhs[-1] = 1.0
    return spsolve(a.tocsc(), rhs)


def _birth_death(birth: float, death, top: int):
    """Generator of a birth-death chain on 0..top (births stop at top), death(n) the rate down
    from n."""
    from scipy import sparse

    n = np.arange(top + 1)
    up = np.where(n < top, birth, 0.0)
    down = np.array([death(k) if k else 0.0 for k in n])
    return sparse.diags([down[1:], -(up + down), up[:-1]], [-1, 0, 1], format="csr")


def _means(pi: np.ndarray, lam: float, running) -> dict:
    """W, Wq, L, Lq and P(wait) of a chain on the number present, ``running(n)`` of them being
    served."""
    n = np.arange(len(pi))
    served = np.array([running(k) for k in n])
    length, lq = float(n @ pi), float((n - served) @ pi)
    return dict(w=length / lam, wq=lq / lam, l=length, lq=lq)


def test_ps_against_its_chain_and_insensitivity():
    # M/M/1-PS: the number present is the M/M/1 chain whatever the order of service.
    lam, mu = 0.7, 1.0
    pi = _stationary(_birth_death(lam, lambda n: mu, 400))
    assert theory.mg1_ps(lam, 1 / mu).w == pytest.approx(
        _means(pi, lam, lambda n: n)["w"], rel=1e-9
    )
    # M/H2/1-PS: sizes exponential of mean 4 (one in five) or 1/4, mean 1 and squared CV 5.5; the
    # state is how many of each kind are present, each of the n present served at rate 1/n.
    # Insensitivity: the same mean time in system as exponential sizes (and the same geometric
    # number present, so the chain truncates at 60).
    from scipy import sparse

    lam, top, p, rates = 0.5, 60, (0.2, 0.8), (0.25, 4.0)
    states = [(i, j) for i in range(top + 1) for j in range(top + 1 - i)]
    index = {s: k for k, s in enumerate(states)}
    rows, cols, vals = [], [], []
    for (i, j), k in index.items():
        n = i + j
        moves = [((i + 1, j), lam * p[0]), ((i, j + 1), lam * p[1])] if n < top else []
        moves += [((i - 1, j), i * rates[0] / n), ((i, j - 1), j * rates[1] / n)] if n else []
        moves = [(to, rate) for to, rate in moves if rate]
        rows += [k] * (len(moves) + 1)
        cols += [index[to] for to, _ in moves] + [k]
        vals += [rate for _, rate in moves] + [-sum(rate for _, rate in moves)]
    pi = _stationary(sparse.csr_matrix((vals, (rows, cols)), shape=(len(states), len(states))))
    length = sum(prob * sum(s) for prob, s in zip(pi, states))
    mean_s = p[0] / rates[0] + p[1] / rates[1]
    assert mean_s == pytest.approx(1.0)
    assert theory.mg1_ps(lam, mean_s).w == pytest.approx(length / lam, rel=1e-9)
    # ... unlike FIFO, where these sizes wait 3.25 times as long as exponential ones (P-K).
    second = 2 * (p[0] / rates[0] ** 2 + p[1] / rates[1] ** 2)
    assert theory.mg1(lam, mean_s, second).wq == pytest.approx(3.25 * theory.mm1(lam, 1.0).wq)


@pytest.mark.parametrize(
    "lam,a,b,mean", [(5.0, 0.010, 0.0002, 200), (12.5, 0.010, 0.0002, 200), (3.0, 0.02, 0.01, 8)]
)
def test_continuous_batching_against_its_chain(lam, a, b, mean):
    from scipy import stats

    top = 1500
    pi = _stationary(_birth_death(lam, lambda n: n / (mean * (a + b * n)), top))
    got = theory.continuous_batching(lam, a, b, mean)
    assert got.w == pytest.approx(_means(pi, lam, lambda n: n)["w"], rel=1e-9)
    assert got.l == pytest.approx(lam * got.w)
    # The stationary law is negative binomial (r + 1, 1 - c), r = a / b, c = lam E[L] b, as the
    # docstring derives.
    c = lam * mean * b
    assert pi[:200] == pytest.approx(stats.nbinom.pmf(np.arange(200), a / b + 1, 1 - c), abs=1e-12)


def test_continuous_batching_limits():
    # No step overhead: processor sharing of E[S] = E[L] b. No per-sequence cost: M/M/inf, W = E[L]
    # a.
    assert theory.continuous_batching(0.5, 0.0, 0.01, 100).w == pytest.approx(
        theory.mg1_ps(0.5, 1.0).w
    )
    assert theory.continuous_batching(50.0, 0.01, 0.0, 100).w == pytest.approx(1.0)
    # A cap that is never reached changes nothing; a cap of one is M/M/1 with service E[L] (a + b).
    far = theory.continuous_batching_capped(5.0, 0.010, 0.0002, 200, 2000)
    free = theory.continuous_batching(5.0, 0.010, 0.0002, 200)
    assert far.w == pytest.approx(free.w, rel=1e-9) and far.wq == pytest.approx(0.0, abs=1e-12)
    one = theory.continuous_batching_capped(0.3, 0.010, 0.0002, 200, 1)
    mm1 = theory.mm1(0.3, 1 / (200 * 0.0102))
    assert (one.w, one.wq, one.p_wait) == pytest.approx((mm1.w, mm1.wq, mm1.p_wait), rel=1e-9)


@pytest.mark.parametrize(
    "lam,a,b,mean,K",
    [(5.0, 0.010, 0.0002, 200, 16), (5.0, 0.010, 0.0002, 200, 24), (2.0, 0.05, 0.01, 10, 3)],
)
def test_capped_batching_against_its_chain(lam, a, b, mean, K):
    top = 3000

    def running(n):
        return min(n, K)

    pi = _stationary(_birth_death(lam, lambda n: running(n) / (mean * (a + b * running(n))), top))
    want = _means(pi, lam, running)
    got = theory.continuous_batching_capped(lam, a, b, mean, K)
    # (rel 1e-7: the sparse solver's rounding on probabilities of a few in a thousand)
    assert (got.w, got.wq, got.l, got.lq) == pytest.approx(
        (want["w"], want["wq"], want["l"], want["lq"]), rel=1e-7
    )
    assert got.p_wait == pytest.approx(float(pi[K:].sum()), rel=1e-7)


def _bulk_generator(lam: float, mu: float, K: int, top: int):
    """State 0: idle; state 1 + n: busy with n waiting (n = 0..top)."""
    from scipy import sparse

    q = sparse.lil_matrix((top + 2, top + 2))
    q[0, 1] = lam  # an arrival to an idle server starts a batch of one
    for n in range(top + 1):
        i = 1 + n
        if n < top:
            q[i, i + 1] = lam
        # the batch ends; the next takes up to K of the waiting
        q[i, 0 if n == 0 else 1 + max(n - K, 0)] = mu
        q[i, i] = -(mu + (lam if n < top else 0.0))
    q[0, 0] = -lam
    return q


@pytest.mark.parametrize("lam,mu,K", [(3.0, 1.0, 4), (0.5, 1.0, 1), (7.0, 1.0, 8), (1.0, 2.0, 3)])
def test_bulk_service_against_its_chain(lam, mu, K):
    pi = _stationary(_bulk_generator(lam, mu, K, 2000))
    waiting = np.concatenate([[0], np.arange(len(pi) - 1)])
    lq = float(waiting @ pi)
    got = theory.bulk_service(lam, mu, K)
    assert got.lq == pytest.approx(lq, rel=1e-9)
    assert got.wq == pytest.approx(lq / lam, rel=1e-9) and got.w == pytest.approx(
        lq / lam + 1 / mu, rel=1e-9
    )
    assert got.p_wait == pytest.approx(1 - pi[0], rel=1e-9)
    # The waiting count is geometric of ratio r0 beyond 0 (checked where the probabilities are well
    # above rounding).
    r0 = theory.bulk_service_root(lam, mu, K)
    assert pi[3:10] / pi[2:9] == pytest.approx(np.full(7, r0), rel=1e-7)
    assert (
        mu * r0 ** (K + 1) - (lam + mu) * r0 + lam == pytest.approx(0.0, abs=1e-12) and 0 < r0 < 1
    )


def test_bulk_service_of_one_is_mm1():
    q, mm1 = theory.bulk_service(0.9, 1.0, 1), theory.mm1(0.9, 1.0)
    assert theory.bulk_service_root(0.9, 1.0, 1) == pytest.approx(0.9)
    assert (q.wq, q.w, q.lq, q.p_wait) == pytest.approx(
        (mm1.wq, mm1.w, mm1.lq, mm1.p_wait), rel=1e-9
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda: theory.mg1_ps(1.0, 1.0),
        lambda: theory.continuous_batching(5.0, 0.01, 0.001, 200),
        lambda: theory.continuous_batching(5.0, 0.0, 0.0, 200),
        lambda: theory.continuous_batching(5.0, 0.01, 0.0, 0.5),
        lambda: theory.continuous_batching_capped(5.0, 0.010, 0.0002, 200, 12),
        lambda: theory.continuous_batching_capped(5.0, 0.010, 0.0002, 200, 0),
        lambda: theory.bulk_service(4.0, 1.0, 4),
        lambda: theory.bulk_service(1.0, 1.0, 0),
    ],
)
def test_sharing_refuses_what_has_no_answer(call):
    with pytest.raises(ValueError):
        call()


def test_batching_in_steps_against_the_continuous_forms():
    # In a busy batch the steps add about a / (2 (1 - c)): the wait for the step in flight to end.
    for lam in (5.0, 12.5):
        cont = theory.continuous_batching(lam, 0.010, 0.0002, 200).w
        steps = theory.continuous_batching_steps(lam, 0.010, 0.0002, 200)
        assert steps - cont == pytest.approx(0.010 / (2 * (1 - lam * 200 * 0.0002)), rel=1e-3)
    # A cap that is never reached changes nothing; with K = 16 the gap is of the same size.
    free = theory.continuous_batching_steps(5.0, 0.010, 0.0002, 200)
    assert theory.continuous_batching_steps(5.0, 0.010, 0.0002, 200, 400) == pytest.approx(
        free, rel=1e-9
    )
    capped = theory.continuous_batching_steps(5.0, 0.010, 0.0002, 200, 16)
    assert capped / theory.continuous_batching_capped(
        5.0, 0.010, 0.0002, 200, 16
    ).w - 1 == pytest.approx(0.002, abs=5e-4)
    # No step overhead: processor sharing, the closer the more tokens a request has.
    gaps = [abs(theory.continuous_batching_steps(0.5, 0.0, 1 / m, m) / 2.0 - 1) for m in (2, 5, 20)]
    assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 1e-3
    # No per-sequence cost: every request is in for its own steps, plus the wait for the step in
    # flight.
    lone = theory.continuous_batching_steps(1e-4, 0.010, 0.0, 5)
    assert lone == pytest.approx(5 * 0.010, rel=1e-3)
    with pytest.raises(ValueError):
        theory.continuous_batching_steps(5.0, 0.010, 0.0002, 200, 12)


# ---------------------------------------------------------------- fleets behind a router


def test_random_routing_is_thinned_mm1():
    assert theory.random_routing(3.2, 1.0, 4) == theory.mm1(0.8, 1.0)
    with pytest.raises(ValueError):
        theory.random_routing(4.0, 1.0, 4)


def test_round_robin_solves_the_gi_m1_root():
    # One replica: every arrival, M/M/1 (sigma = rho).
    assert theory.round_robin(0.8, 1.0, 1).wq == pytest.approx(theory.mm1(0.8, 1.0).wq, rel=1e-9)
    q = theory.round_robin(3.2, 1.0, 4)
    sigma = q.p_wait
    assert sigma == pytest.approx((3.2 / (3.2 + 1.0 * (1 - sigma))) ** 4, rel=1e-12)
    assert q.wq == pytest.approx(sigma / (1 - sigma)) and 0 < sigma < 0.8
    # More regular arrivals wait less; the many-replica limit is D/M/1,
    # sigma = exp(-(1 - sigma) / rho).
    waits = [theory.round_robin(0.8 * n, 1.0, n).wq for n in (1, 2, 4, 16)]
    assert waits == sorted(waits, reverse=True)
    dm1 = optimize_root(lambda s: np.exp(-(1 - s) / 0.8) - s)
    assert theory.round_robin(0.8 * 4000, 1.0, 4000).p_wait == pytest.approx(dm1, rel=1e-3)
    with pytest.raises(ValueError):
        theory.round_robin(4.0, 1.0, 4)


def optimize_root(f):
    from scipy.optimize import brentq

    return brentq(f, 1e-9, 0.999)


def test_power_of_d_is_mitzenmachers_fixed_point():
    # d = 1 is M/M/1; the mean-field tails s_i solve lam (s_(i-1)^d - s_i^d) = mu (s_i - s_(i+1)).
    assert theory.power_of_d(0.9, 1.0, 1).w == pytest.approx(theory.mm1(0.9, 1.0).w)
    rho, d = 0.9, 2
    s = [theory.power_of_d_tail(rho, d, i) for i in range(12)]
    assert s[0] == 1 and s[1] == pytest.approx(rho)
    for i in range(1, 10):
        assert rho * (s[i - 1] ** d - s[i] ** d) == pytest.approx(s[i] - s[i + 1], abs=1e-15)
    q = theory.power_of_d(rho, 1.0, d)
    assert q.l == pytest.approx(sum(s[1:]), rel=1e-12) and q.w == pytest.approx(q.l / rho)
    assert q.w == pytest.approx(2.6141, abs=1e-4)  # sum of 0.9^(2^i - 2), i >= 1
    # More choices wait less, and all of them far less than one M/M/1 at rho 0.9 (W = 10 s).
    ws = [theory.power_of_d(rho, 1.0, k).w for k in (1, 2, 3, 10)]
    assert ws == sorted(ws, reverse=True) and ws[1] < ws[0] / 3
    with pytest.raises(ValueError):
        theory.power_of_d(0.9, 1.0, 0)

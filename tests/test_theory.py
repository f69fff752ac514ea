"""Closed forms against each other and against textbook identities (the simulator checks are in test_validation)."""

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
    assert theory.mg1(lam, mean, mean**2 * (1 + scv)).wq == pytest.approx(0.9 * mean * (1 + scv) / 0.2)


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


@pytest.mark.parametrize("call", [
    lambda: theory.mm1(1.0, 1.0), lambda: theory.mm1(-1, 1), lambda: theory.mmc(2.0, 1.0, 2),
    lambda: theory.mg1(10, 0.1, 0.02), lambda: theory.mmck(1, 1, 2, 1), lambda: theory.erlang_c(2, 2.0),
    lambda: theory.erlang_b(-1, 1.0), lambda: theory.mmc(1, 1, 0),
])
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
    assert theory.erlang_a(1.8, 1.0, 2, 1e-7).p_wait == pytest.approx(theory.mmc(1.8, 1.0, 2).p_wait, rel=1e-4)
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
    assert theory.mmc_deterministic_patience(0.5, 1.0, 1, 3.0) == pytest.approx(0.5 * 0.5 * e / (1 - 0.25 * e))
    # No patience at all is the loss system (Erlang B); endless patience abandons nobody.
    assert theory.mmc_deterministic_patience(6.0, 1.0, 8, 0.0) == pytest.approx(theory.erlang_b(8, 6.0))
    assert theory.mmc_deterministic_patience(6.0, 1.0, 8, 1e3) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("call", [
    lambda: theory.erlang_a(1.0, 1.0, 2, 0.0), lambda: theory.erlang_a(1.0, 1.0, 0, 1.0),
    lambda: theory.mmc_deterministic_patience(2.0, 1.0, 2, 1.0),
    lambda: theory.mmc_deterministic_patience(0.5, 1.0, 1, -1.0),
])
def test_impatience_refuses_what_has_no_answer(call):
    with pytest.raises(ValueError):
        call()

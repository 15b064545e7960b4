"""pass@k against exact enumeration and exact rational arithmetic (the evaluation's headline numbers)."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from sage.metrics import pass_at_k, pass_at_k_curve


def _enumerated(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (the first c correct) that contain a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


def _exact(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


@pytest.mark.parametrize("n", range(1, 9))
def test_matches_enumeration_of_all_subsets(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_enumerated(n, c, k), abs=1e-15), (n, c, k)


def test_known_values() -> None:
    assert pass_at_k(5, 1, 1) == pytest.approx(0.2, rel=1e-15)
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - 21 / 45, rel=1e-15)
    assert pass_at_k(256, 0, 1) == 0.0
    assert pass_at_k(256, 256, 256) == 1.0


def test_exact_at_n_1024() -> None:
    n = 1024
    cs = np.arange(n + 1)
    ks = np.array([1, 2, 5, 16, 64, 100, 256, 512, 1000, 1024])
    got = pass_at_k(n, cs[:, None], ks[None, :])
    for ci, c in enumerate(cs):
        for ki, k in enumerate(ks):
            exact = float(_exact(n, int(c), int(k)))
            assert got[ci, ki] == pytest.approx(exact, rel=1e-12, abs=1e-300), (c, k)


def test_exactly_one_when_every_subset_has_a_correct_sample() -> None:
    assert pass_at_k(256, 200, 57) == 1.0
    assert pass_at_k(256, 1, 256) == 1.0
    assert pass_at_k(10, 5, 6) == 1.0


def test_scalar_in_float_out_and_broadcasting() -> None:
    assert type(pass_at_k(np.int64(8), 3, 2)) is float
    got = pass_at_k(8, np.array([0, 1, 8]), np.array([[1], [4]]))
    assert got.shape == (2, 3)
    assert got[1, 1] == pytest.approx(_enumerated(8, 1, 4))


def test_monotone_in_k() -> None:
    for c in (0, 1, 7, 100, 255, 256):
        values = pass_at_k(256, c, np.arange(1, 257))
        assert np.all(np.diff(values) >= -1e-15), c


@pytest.mark.parametrize(
    ("n", "c", "k", "bad"),
    [(5, 6, 1, "c=6"), (5, -1, 1, "c=-1"), (5, 2, 0, "k=0"), (5, 2, 6, "k=6"), (5, 2.5, 1, "c=2.5")],
)
def test_invalid_inputs_raise_naming_the_value(n: float, c: float, k: float, bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        pass_at_k(n, c, k)


def test_curve_endpoints() -> None:
    rng = np.random.default_rng(0)
    correct = rng.random((50, 16)) < rng.random((50, 1))  # per-problem difficulty
    correct[0] = False
    curve = pass_at_k_curve(correct)
    assert list(curve) == list(range(1, 17))
    assert curve[1] == pytest.approx(correct.mean(), rel=1e-12)
    assert curve[16] == pytest.approx(correct.any(axis=1).mean(), rel=1e-15)
    assert all(curve[k] <= curve[k + 1] + 1e-15 for k in range(1, 16))
    assert pass_at_k_curve(correct, ks=[4]) == {4: pytest.approx(curve[4])}


def test_curve_rejects_non_matrix_and_bad_k() -> None:
    with pytest.raises(ValueError, match="matrix"):
        pass_at_k_curve(np.ones(5, dtype=bool))
    with pytest.raises(ValueError, match="k=9"):
        pass_at_k_curve(np.ones((2, 8), dtype=bool), ks=[9])

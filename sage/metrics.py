"""Unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code").

With n samples of which c are correct, pass@k = 1 - C(n-c, k) / C(n, k): the probability that a random
k-subset of the n samples contains a correct one. The binomials overflow floats long before n = 256, so the
ratio is computed as prod_{i=n-c+1}^{n} (1 - k/i) in log space, which stays accurate to ~1e-14 at n = 1024.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike


def metric_name(label: str, dataset: str, figure: str) -> str:
    """The one name of an evaluation figure in MLflow, ``metrics.json``, sage-eval's run and the sweeper's
    objectives: ``<figure>/<label>/<dataset>``, the part that tells two charts apart first (MLflow's UI cuts
    long names from the right), with '@' spelt '_at_' (MLflow allows no '@' in a name). pass@1 of the
    trained model on arith_heldout: ``pass_at_1/trained/arith_heldout``; label ``periodic`` for the
    evaluation during training."""
    return f"{figure.replace('@', '_at_')}/{label}/{dataset}"


# Elements of the (values x n) term matrix evaluated at once: bounds memory for large broadcasts.
_CHUNK_ELEMENTS = 1 << 22


def _as_int_array(name: str, value: ArrayLike) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype == bool or not np.issubdtype(array.dtype, np.number):
        raise ValueError(f"pass_at_k: {name} must be an integer, got {value!r}")
    integral = np.asarray(array, dtype=np.int64)
    if np.any(integral != array):
        bad = array.flat[np.flatnonzero(integral != array)[0]].item()
        raise ValueError(f"pass_at_k: {name}={bad} is not an integer")
    return integral


def _check(n: np.ndarray, c: np.ndarray, k: np.ndarray) -> None:
    """Raise ValueError naming the first element that violates 0 <= c <= n or 1 <= k <= n."""
    for ok, name, values in (
        ((c >= 0) & (c <= n), "c", c),
        ((k >= 1) & (k <= n), "k", k),
    ):
        if not np.all(ok):
            first = np.flatnonzero(~ok)[0]
            bound = "0 <= c <= n" if name == "c" else "1 <= k <= n"
            raise ValueError(f"pass_at_k: {name}={values.flat[first]} violates {bound} (n={n.flat[first]})")


def _log_ratio(n: np.ndarray, c: np.ndarray, k: np.ndarray) -> np.ndarray:
    """log(C(n-c, k) / C(n, k)) = sum_{i=n-c+1}^{n} log1p(-k/i) for flat arrays with n - c >= k.

    Terms outside (n-c, n] are masked to log1p(0) = 0; numpy's pairwise summation keeps the rounding error
    at a few ulps of the result even for a thousand terms.
    """
    i = np.arange(1, int(n.max(initial=1)) + 1)
    out = np.empty(n.shape, dtype=np.float64)
    rows = max(1, _CHUNK_ELEMENTS // len(i))
    for start in range(0, len(n), rows):
        nn, cc, kk = (a[start : start + rows, None] for a in (n, c, k))
        inside = (i > nn - cc) & (i <= nn)
        out[start : start + rows] = np.log1p(-np.where(inside, kk / i, 0.0)).sum(axis=1)
    return out


def pass_at_k(n: ArrayLike, c: ArrayLike, k: ArrayLike) -> float | np.ndarray:
    """Unbiased pass@k from n samples with c correct; n, c, k broadcast like numpy arrays.

    Returns a float when all three are scalars. Exactly 1.0 when n - c < k (every k-subset holds a
    correct sample) and exactly 0.0 when c == 0. Raises ValueError unless 0 <= c <= n and 1 <= k <= n.
    """
    n_arr, c_arr, k_arr = (_as_int_array(name, v) for name, v in (("n", n), ("c", c), ("k", k)))
    n_arr, c_arr, k_arr = np.broadcast_arrays(n_arr, c_arr, k_arr)
    _check(n_arr, c_arr, k_arr)
    n_flat, c_flat, k_flat = (a.ravel() for a in (n_arr, c_arr, k_arr))
    result = np.ones(n_flat.shape, dtype=np.float64)
    some_miss = n_flat - c_flat >= k_flat
    # -expm1(x) = 1 - exp(x), without cancellation when pass@k is tiny.
    result[some_miss] = -np.expm1(_log_ratio(n_flat[some_miss], c_flat[some_miss], k_flat[some_miss]))
    if n_arr.ndim == 0:
        return float(result[0])
    return result.reshape(n_arr.shape)


def pass_at_k_curve(correct: ArrayLike, ks: Sequence[int] | None = None) -> dict[int, float]:
    """Mean over problems of pass@k, for each k in `ks` (default 1..n), from a boolean
    (problems x samples) correctness matrix with the same number of samples n for every problem."""
    matrix = np.asarray(correct)
    if matrix.ndim != 2 or matrix.shape[0] == 0 or matrix.shape[1] == 0:
        raise ValueError(f"correct must be a non-empty (problems x samples) matrix, got shape {matrix.shape}")
    n = matrix.shape[1]
    k_values = list(range(1, n + 1)) if ks is None else [int(k) for k in ks]
    c = matrix.astype(bool).sum(axis=1)
    per_problem = pass_at_k(n, c[:, None], np.asarray(k_values, dtype=np.int64)[None, :])
    return {k: float(mean) for k, mean in zip(k_values, per_problem.mean(axis=0), strict=True)}


def pass_at_k_over_seeds(correct_by_seed: list[np.ndarray], ks: list[int]) -> dict[str, float]:
    """pass@k per seed -> mean and std over seeds, for each reported k."""
    curves = [pass_at_k_curve(c, ks) for c in correct_by_seed]
    out = {}
    for k in ks:
        vals = np.array([c[k] for c in curves])
        out[f"pass@{k}"] = float(vals.mean())
        out[f"pass@{k}_std"] = float(vals.std(ddof=1)) if len(vals) > 1 else 0.0
    return out


def pass_at_k_curve_over_seeds(correct_by_seed: list[np.ndarray]) -> dict[str, list[float]]:
    """pass@k for every k in 1..n: per seed, mean and std over seeds (Figure 3 of the paper)."""
    per_seed = np.array([list(pass_at_k_curve(c).values()) for c in correct_by_seed])  # (seeds, n)
    std = per_seed.std(axis=0, ddof=1) if len(per_seed) > 1 else np.zeros(per_seed.shape[1])
    return {
        "k": list(range(1, per_seed.shape[1] + 1)),
        "mean": per_seed.mean(axis=0).tolist(),
        "std": std.tolist(),
        "per_seed": per_seed.tolist(),
    }

"""Guides q_t > 0 that reshape the anchor: pi_ref -> q * pi_ref, per token (docs/method.md, "The guides").

A guide is computed from signals of the forward pass TRL already runs (sampled-token log-probs and
next-token entropies), is detached (no gradient flows through q), is clamped to [q_min, q_max] and is 1
on padding. Pure functions do the maths; the small classes hold hyperparameters and the schedule.

A guide is called with what identifies the micro-batch it shapes: ``step`` (the optimiser step its
generation batch was generated at; it also sets the schedule's position), ``rank`` (the process) and
``micro`` (its index inside the generation batch). The noise of the random and token guides is a pure
function of (seed, step, rank, micro): a resumed run draws what an uninterrupted one draws, processes
draw different noise, and a micro-batch seen again (``num_iterations > 1``) gets the same q.

Shapes: ``logps``, ``entropies``, ``mask`` and the returned ``q`` are all (B, T). ``fork`` (B, T), when
the model's vocabulary has the testbed fork world's strategy markers, marks the tokens that choose a
strategy; only the fork guides (controls, not methods) read it.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

Schedule = Callable[[float, float, int], float]
Normalisation = Literal["minmax", "rank", "zscore"]


def check_range(name: str, value: float, low: float, high: float = math.inf) -> None:
    """A guide hyperparameter outside [low, high], infinite or NaN is a one-line error naming its key."""
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"guide.{name} must be in [{low}, {high}] (got {value})")


def check_clamp(q_min: float, q_max: float) -> None:
    check_range("q_min", q_min, 1e-6, 1.0)  # log q must exist, and q == 1 (no shaping) must be reachable
    check_range("q_max", q_max, 1.0)


def noise_seed(seed: int, step: int, rank: int, micro: int, person: bytes = b"") -> int:
    """A generator seed that is a pure function of (seed, step, rank, micro): 63 bits of the BLAKE2b digest
    of the four integers (a documented hash, unlike Python's hash(), so a seed means the same noise on any
    interpreter). ``person`` personalises the hash, so another use of the same four integers (the
    training rollouts) draws another stream."""
    packed = struct.pack("<4q", seed, step, rank, micro)
    digest = hashlib.blake2b(packed, digest_size=8, person=person).digest()
    return int.from_bytes(digest, "little") >> 1


def noise_generator(seed: int, step: int, rank: int, micro: int) -> torch.Generator:
    """A CPU generator seeded by ``noise_seed``: the noise of one micro-batch."""
    return torch.Generator().manual_seed(noise_seed(seed, step, rank, micro))


def finalize(q: torch.Tensor, mask: torch.Tensor, q_min: float, q_max: float) -> torch.Tensor:
    """Clamp to [q_min, q_max] and set padding to exactly 1 (log q = 0 there)."""
    return torch.where(mask.bool(), q.clamp(q_min, q_max), torch.ones_like(q))


def random_q(mask: torch.Tensor, eps: float, sigma: float, generator: torch.Generator | None) -> torch.Tensor:
    """Eq. 9: with probability eps, q_t = 1 + sigma * N(0, 1); otherwise 1 (before clamping)."""
    active = torch.rand(mask.shape, generator=generator, device="cpu") < eps  # (B, T)
    noise = torch.randn(mask.shape, generator=generator, device="cpu")  # (B, T)
    q = torch.where(active, 1.0 + sigma * noise, torch.ones_like(noise))
    return q.to(mask.device)


def normalise_per_sequence(x: torch.Tensor, mask: torch.Tensor, method: Normalisation) -> torch.Tensor:
    """Map x to [0, 1] within each sequence over its valid tokens (padding gets 0).

    minmax: min-max after clipping to the sequence's 5%-95% quantiles (robust to one huge surprisal);
    rank: rank / (n - 1), ties at their average rank; zscore: sigmoid of the z-score. A constant sequence
    maps to 0 (rank and zscore would give 0.5: we return 0 for every method so that 'no signal' means 'no
    shaping')."""
    valid = mask.bool()  # (B, T)
    xs = x.masked_fill(~valid, float("nan"))
    if method == "minmax":
        lo = torch.nanquantile(xs, 0.05, dim=1, keepdim=True)  # (B, 1)
        hi = torch.nanquantile(xs, 0.95, dim=1, keepdim=True)
        span = hi - lo
        w = (torch.minimum(torch.maximum(x, lo), hi) - lo) / span.clamp_min(1e-12)
        w = torch.where(span > 1e-12, w, torch.zeros_like(w))
    elif method == "rank":
        # Tied values share their average rank (a sort's order among ties is arbitrary); padding sorts last.
        filled = xs.nan_to_num(float("inf"))  # (B, T)
        ordered = filled.sort(dim=1).values
        lowest = torch.searchsorted(ordered, filled, right=False)  # (B, T) rank of the first tie
        highest = torch.searchsorted(ordered, filled, right=True) - 1  # rank of the last tie
        n = valid.sum(dim=1, keepdim=True).to(x.dtype)
        w = (lowest + highest).to(x.dtype) / 2 / (n - 1).clamp_min(1.0)
        spread = filled.masked_fill(~valid, float("-inf")).amax(1, keepdim=True) - ordered[:, :1]
        w = torch.where(spread > 0, w, torch.zeros_like(w))
    elif method == "zscore":
        n = valid.sum(dim=1, keepdim=True).clamp_min(1)
        mean = xs.nan_to_num(0.0).sum(dim=1, keepdim=True) / n
        var = ((x - mean) ** 2 * valid).sum(dim=1, keepdim=True) / n
        std = var.sqrt()
        w = torch.sigmoid((x - mean) / std.clamp_min(1e-12))
        w = torch.where(std > 1e-12, w, torch.zeros_like(w))
    else:
        raise ValueError(f"guide.normalisation must be minmax, rank or zscore (got {method!r})")
    return torch.where(valid, w, torch.zeros_like(w))


def token_q(
    logps: torch.Tensor,
    mask: torch.Tensor,
    alpha: float,
    sigma: float,
    normalisation: Normalisation,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Eq. 10: q_t = 1 + alpha * w_t + sigma * w_t * N(0, 1), w_t = normalised surprisal -log pi(y_t)."""
    w = normalise_per_sequence(-logps, mask, normalisation)  # (B, T)
    noise = torch.randn(mask.shape, generator=generator, device="cpu").to(w.device)
    return 1.0 + alpha * w + sigma * w * noise


def branch_q(entropies: torch.Tensor, ratio: float, threshold: float) -> torch.Tensor:
    """Eq. 11: q_t = 1 + ratio * max(0, H_t - threshold), H_t the policy's next-token entropy at t."""
    return 1.0 + ratio * (entropies - threshold).clamp_min(0.0)


@dataclass
class NoGuide:
    """q == 1: the anchor is pi_ref itself (plain GRPO / forward-KL baselines)."""

    def __call__(
        self, *, logps, ref_logps, entropies, mask, step: int, rank: int = 0, micro: int = 0, fork=None
    ):
        return torch.ones_like(logps)

    def params(self, step: int) -> dict[str, float]:
        return {}


@dataclass
class RandomGuide:
    """Random guide (Eq. 9). eps and sigma anneal with the schedule from start to end."""

    schedule: Schedule
    eps_start: float = 0.1
    eps_end: float = 0.0
    sigma_start: float = 0.15
    sigma_end: float = 0.05
    q_min: float = 0.6
    q_max: float = 1.4
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("eps_start", "eps_end"):
            check_range(name, getattr(self, name), 0.0, 1.0)
        for name in ("sigma_start", "sigma_end"):
            check_range(name, getattr(self, name), 0.0)
        check_clamp(self.q_min, self.q_max)

    def params(self, step: int) -> dict[str, float]:
        return {
            "eps": self.schedule(self.eps_start, self.eps_end, step),
            "sigma": self.schedule(self.sigma_start, self.sigma_end, step),
        }

    def __call__(
        self, *, logps, ref_logps, entropies, mask, step: int, rank: int = 0, micro: int = 0, fork=None
    ):
        p = self.params(step)
        noise = noise_generator(self.seed, step, rank, micro)
        return finalize(random_q(mask, p["eps"], p["sigma"], noise), mask, self.q_min, self.q_max)


@dataclass
class TokenGuide:
    """Surprisal guide (Eq. 10). alpha and sigma anneal with the schedule. The surprisal is that of the
    current policy (the log-probs of TRL's loss pass, detached) or of pi_ref (source='ref')."""

    schedule: Schedule
    alpha_start: float = 0.3
    alpha_end: float = 0.1
    sigma_start: float = 0.25
    sigma_end: float = 0.1
    normalisation: Normalisation = "minmax"
    source: Literal["policy", "ref"] = "policy"
    q_min: float = 0.6
    q_max: float = 1.4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.source not in ("policy", "ref"):
            raise ValueError(f"guide.source must be 'policy' or 'ref' (got {self.source!r})")
        for name in ("alpha_start", "alpha_end", "sigma_start", "sigma_end"):
            check_range(name, getattr(self, name), 0.0)
        check_clamp(self.q_min, self.q_max)

    def params(self, step: int) -> dict[str, float]:
        return {
            "alpha": self.schedule(self.alpha_start, self.alpha_end, step),
            "sigma": self.schedule(self.sigma_start, self.sigma_end, step),
        }

    def __call__(
        self, *, logps, ref_logps, entropies, mask, step: int, rank: int = 0, micro: int = 0, fork=None
    ):
        p = self.params(step)
        source = ref_logps if self.source == "ref" else logps
        if source is None:
            raise ValueError(
                "guide.source='ref' needs a reference model; it is not loaded with divergence=none"
            )
        noise = noise_generator(self.seed, step, rank, micro)
        q = token_q(source.detach(), mask, p["alpha"], p["sigma"], self.normalisation, noise)
        return finalize(q, mask, self.q_min, self.q_max)


@dataclass
class BranchGuide:
    """Entropy-gated guide (Eq. 11), the paper's main variant. Constant by design (no schedule)."""

    ratio: float = 0.3
    threshold: float = 1.2
    q_min: float = 0.6
    q_max: float = 1.4

    def __post_init__(self) -> None:
        check_range("ratio", self.ratio, 0.0)
        check_range("threshold", self.threshold, 0.0)  # an entropy in nats
        check_clamp(self.q_min, self.q_max)

    def params(self, step: int) -> dict[str, float]:
        return {"ratio": self.ratio, "threshold": self.threshold}

    def __call__(
        self, *, logps, ref_logps, entropies, mask, step: int, rank: int = 0, micro: int = 0, fork=None
    ):
        return finalize(
            branch_q(entropies.detach(), self.ratio, self.threshold), mask, self.q_min, self.q_max
        )


@dataclass
class ForkGuide:
    """A control, not a method: q = ``q`` exactly at the tokens where the testbed's fork world chooses a
    strategy (``fork``), 1 elsewhere. It is an oracle for WHERE exploration is decided, not for what to
    choose there: every strategy token gets the same q. Under per-token k3 (``divergence=reverse_kl``) it
    is therefore beta x q at the fork, a stronger pull towards pi_ref, whose target stays pi_ref
    (docs/anchors.md); under ``divergence=sequence_kl`` it multiplies every completion that passes the
    fork once by the same q, which normalisation removes. So if it does not move the outcome, that bounds
    what a guide of the paper's clamp does here through a per-position strength, and nothing else: a
    token-dependent guide of the same size (q above 1 for one strategy's token only), or one whose q(y)
    differs between completions under the sequence anchor, moves the target itself, and this control
    says nothing about those."""

    q: float = 1.4

    def __post_init__(self) -> None:
        check_range("q", self.q, 1e-6)

    def params(self, step: int) -> dict[str, float]:
        return {"q": self.q}

    def __call__(
        self, *, logps, ref_logps, entropies, mask, step: int, rank: int = 0, micro: int = 0, fork=None
    ):
        if fork is None:
            raise ValueError("guide=fork needs a model of the testbed's fork world (model=tiny_fork)")
        return torch.where(fork.bool() & mask.bool(), torch.full_like(logps, self.q), torch.ones_like(logps))


def rare_fork_q(ref_logps: torch.Tensor, fork: torch.Tensor, q: float, p_max: float) -> torch.Tensor:
    """q at the fork tokens pi_ref makes rare (pi_ref(v|h) < p_max), 1 elsewhere. The test is on the
    sampled token's own reference probability, so q depends on the token chosen, not only on the
    position: that is what tilts the per-position target of k3 (docs/anchors.md)."""
    rare = fork.bool() & (ref_logps < math.log(p_max))  # (B, T)
    return torch.where(rare, torch.full_like(ref_logps, q), torch.ones_like(ref_logps))


@dataclass
class RareForkGuide:
    """A positive control, not a method (issue 42): q = ``q`` at the fork world's strategy tokens whose
    reference probability is below ``p_max``, 1 elsewhere. Unlike ForkGuide it favours WHAT is chosen:
    under per-token k3 the target at the fork becomes q(v) pi_ref(v) / sum_u q(u) pi_ref(u), tilted
    towards the rare strategies; under ``divergence=sequence_kl`` it multiplies the completions that take
    a rare strategy by q. The guide sees no token ids (the trainer passes only where the fork is), so
    "rare" is read from pi_ref: with the fork world's prior (FORK_PRIOR: 0.45, 0.2, 0.15, 0.1, 0.05,
    0.05) the default 0.065, between 0.05 and 0.1 on a log scale, selects ``ctens`` and ``round`` (the
    rare strategy that solves tail problems). ``train/guide/active_frac_fork`` logs the share of fork
    tokens it acts on, about 0.09 at the start if the base model keeps its prior."""

    q: float = 4.0
    p_max: float = 0.065

    def __post_init__(self) -> None:
        check_range("q", self.q, 1e-6)
        check_range("p_max", self.p_max, 1e-9, 1.0)

    def params(self, step: int) -> dict[str, float]:
        return {"q": self.q, "p_max": self.p_max}

    def __call__(
        self, *, logps, ref_logps, entropies, mask, step: int, rank: int = 0, micro: int = 0, fork=None
    ):
        if fork is None:
            raise ValueError("guide=fork_rare needs a model of the testbed's fork world (model=tiny_fork)")
        if ref_logps is None:
            raise ValueError(
                "guide=fork_rare reads pi_ref's probabilities; divergence=none loads no reference"
            )
        return torch.where(mask.bool(), rare_fork_q(ref_logps.detach(), fork, self.q, self.p_max), 1.0)


EntropyLevel = Literal["response", "batch"]


def high_entropy(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    quantile: float,
    threshold: float | None,
    level: EntropyLevel,
) -> torch.Tensor:
    """Archer's token split: (B, T) True at the unmasked tokens whose entropy is strictly above the cut.

    The cut is ``threshold`` (nats) when it is set; otherwise the ``quantile`` of the unmasked entropies
    (linear interpolation, torch's and numpy's default), taken over each completion (``level='response'``,
    one cut per row: Archer's code, ``torch.nanquantile(..., dim=-1)``) or over the whole micro-batch the
    guide is handed (``level='batch'``). Strictly above, as Archer's code (``entropy > q``): tokens tied at
    the cut, a constant completion and a one-token completion are all low-entropy, so a completion of
    zero-entropy tokens keeps its anchor. Masked tokens take no part in the quantile and are never high."""
    valid = mask.bool()
    h = entropies.detach()
    if h.dtype not in (torch.float32, torch.float64):  # quantile needs a full-precision float
        h = h.float()
    if threshold is not None:
        return valid & (h > threshold)
    if level == "response":
        # a row with no valid token gets a NaN cut, and nothing compares above NaN
        cut = torch.nanquantile(h.masked_fill(~valid, float("nan")), quantile, dim=1, keepdim=True)  # (B, 1)
    elif level == "batch":
        if not valid.any():
            return valid
        cut = torch.quantile(h[valid], quantile)  # the valid tokens only: quantile's input has a size limit
    else:
        raise ValueError(f"guide.level must be 'response' or 'batch' (got {level!r})")
    return valid & (h > cut)


# exp of a float32 log-ratio stays a normal number within +-80 nats, so log(exp(x)) gives x back
RELEASE_LOG_RATIO = 80.0


@dataclass
class ArcherGuide:
    """Archer (arXiv 2507.15778, "Stabilizing Knowledge, Promoting Reasoning: Dual-Token Constraints for
    RLVR") as a guide: q_t = ``q_high`` at high-entropy ("reasoning") tokens, ``q_low`` at the others
    ("knowledge"), the split by ``high_entropy``: the ``quantile`` (0.8: the top 20 % are high) of each
    completion's entropies by default, or of the micro-batch's (``level='batch'``), or a fixed
    ``threshold`` in nats, which when set replaces the quantile. Archer itself thresholds each response at
    its own 0.8-quantile (response level; its code, ``token_entropy_quantile=0.8``).

    What q does to the anchor. With k3 (``divergence=reverse_kl``) the trainer's term at a token is
    k3(log pi, log pi_ref + log q_t). For a q_t that does not depend on the sampled token (it depends on the
    position's entropy only), its on-policy expected gradient with respect to that position's logits z is

        E_v~pi[(1 - q_t pi_ref(v)/pi(v)) grad_z log pi(v)] = -q_t sum_v pi_ref(v) (e_v - pi)
                                                           = q_t (pi - pi_ref)

    (docs/anchors.md): the pull towards pi_ref itself, multiplied by q_t, i.e. beta_t = beta * q_t (the
    cut is a quantile over the completion, later tokens included, so this takes the split as given). Archer
    puts beta on low-entropy tokens and no KL on high-entropy ones (its ``high_entropy_kl_loss_scale_coef``
    is 0), so ``q_low`` = 1 and ``q_high`` = 0. A scalar q of 0 has no log, and a small one is not "no
    KL": the expected pull is q (pi - pi_ref), but each sampled token's gradient (1 - q pi_ref/pi) grad log pi
    tends to grad log pi, a zero-mean noise of beta per token, and the value grows as -log q. So
    ``q_high = 0`` means the token's anchor is the policy itself: q_t = pi(y_t) / pi_ref(y_t) from the
    detached log-probs, so log(q_t pi_ref) = stopgrad(log pi), d = 0, and k3's value and gradient,
    (1 - e^d) grad log pi, are 0 at that token for every sample, not only on average (the same under
    ``divergence.estimator=k2`` and ``importance_weighted``; under ``forward_kl`` the value is 0 and the
    gradient a zero-mean -grad log pi; under ``sequence_kl`` the token drops out of the completion's
    log-ratio). That q depends on the token, and the logged ``guide/q_mean`` then includes
    pi/pi_ref at the high-entropy tokens: exactly 1 wherever the policy is still its reference. Beyond
    +-80 nats of log-ratio (``RELEASE_LOG_RATIO``) the ratio is clamped to stay finite in float32, and the
    release is no longer exact there. A positive ``q_high`` is a per-position strength (weakened below 1).

    Archer's code (token-mean aggregation) averages the low-entropy KL over the low-entropy tokens only,
    about 1/0.8 = 1.25 times the per-token weight of a mean over all tokens; ``q_low = 1.25`` reproduces
    that, the default 1 keeps the run's beta there, as the paper's text states it.

    Against Branch: Branch raises q (pulls harder towards pi_ref) where the entropy is high, Archer
    lowers it there and keeps (or raises) it elsewhere: opposite hypotheses about the same tokens.

    Not done: Archer's dual clip (epsilon 0.2 at low-entropy tokens, 0.5 at high-entropy ones). TRL 1.16's
    loss takes scalar epsilon_low/epsilon_high inside ``_compute_loss``, and per-token ranges would mean
    copying that loss, so the run's ``trl.epsilon`` / ``trl.epsilon_high`` apply to every token."""

    quantile: float = 0.8
    threshold: float | None = None
    level: EntropyLevel = "response"
    q_high: float = 0.0
    q_low: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.quantile) and 0.0 < self.quantile < 1.0):
            raise ValueError(f"guide.quantile must be in (0, 1) (got {self.quantile})")
        if self.threshold is not None:
            check_range("threshold", self.threshold, 0.0)  # an entropy in nats
        if self.level not in ("response", "batch"):
            raise ValueError(f"guide.level must be 'response' or 'batch' (got {self.level!r})")
        if self.q_high != 0.0:  # 0 is the release (the anchor is the policy itself); else a strength
            check_range("q_high", self.q_high, 1e-6)
        check_range("q_low", self.q_low, 1e-6)

    def params(self, step: int) -> dict[str, float]:
        cut = {"quantile": self.quantile} if self.threshold is None else {"threshold": self.threshold}
        return {**cut, "q_high": self.q_high, "q_low": self.q_low}

    def strength(self, entropies, mask):
        """The anchor's strength at each position under k3, the factor on beta: ``q_low`` at low-entropy
        tokens, ``q_high`` at high-entropy ones, 0 where the anchor is released (``q_high = 0``: there q is
        pi/pi_ref, which is 1 while the policy is its reference, yet k3 pulls with strength 0); 1 on
        padding. What guide diagnostics set beside Branch's q, which is its strength."""
        high = high_entropy(entropies, mask, self.quantile, self.threshold, self.level)
        s = torch.where(high, torch.full_like(entropies, self.q_high), torch.full_like(entropies, self.q_low))
        return torch.where(mask.bool(), s, torch.ones_like(s))

    def __call__(
        self, *, logps, ref_logps, entropies, mask, step: int, rank: int = 0, micro: int = 0, fork=None
    ):
        high = high_entropy(entropies, mask, self.quantile, self.threshold, self.level)  # (B, T)
        if self.q_high == 0.0:
            if ref_logps is None:
                raise ValueError(
                    "guide=archer with q_high=0 reads pi_ref's log-probs; divergence=none loads none"
                )
            log_ratio = (logps.detach() - ref_logps.detach()).clamp(-RELEASE_LOG_RATIO, RELEASE_LOG_RATIO)
            at_high = torch.exp(log_ratio)
        else:
            at_high = torch.full_like(logps, self.q_high)
        q = torch.where(high, at_high, torch.full_like(logps, self.q_low))
        return torch.where(mask.bool(), q, torch.ones_like(q))

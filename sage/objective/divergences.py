"""Per-token divergence terms between the policy and the (shaped) anchor m = q * pi_ref.

Every term has two separate duties (docs/method.md, "The divergences") and each function documents both:
- VALUE: what the returned tensor's forward value estimates (that is what we log);
- GRADIENT: what its gradient estimates in expectation when tokens are sampled on-policy.
Where the pathwise gradient of the value estimator is not the gradient we want (forward KL), the term is
built as ``value.detach() + (surrogate - surrogate.detach())`` so the forward value and the gradient are
each the documented one.

Shapes: ``logp`` and ``ref_logp`` are (B, T) log-probs of the sampled tokens; ``ref_logp`` is
log pi_ref(y_t) + log q_t and carries no gradient. The result is (B, T); the caller masks and aggregates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch


def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """log pi - log m.
    VALUE: unbiased for sum_y pi log(pi/m) (= KL(pi||m) when m is normalised; the pseudo-KL adds 1 - sum m).
    GRADIENT: grad log pi, whose on-policy expectation is ZERO: as a loss k1 does not regularise."""
    return logp - ref_logp


def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """0.5 * (log pi - log m)^2.
    VALUE: a biased, low-variance surrogate, 0.5 E[(log pi/m)^2] (second-order match to KL near pi = m).
    GRADIENT: E[(log pi/m) grad log pi] = grad of the REVERSE pseudo-KL KL~(pi || m), exactly."""
    return 0.5 * (logp - ref_logp) ** 2


def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """exp(d) - d - 1 with d = log m - log pi (Schulman's k3; TRL's GRPO term when q == 1).
    VALUE: >= 0, unbiased for the reverse pseudo-KL KL~(pi || m) = sum pi log(pi/m) - 1 + sum m.
    GRADIENT: E[(1 - m/pi) grad log pi] = -sum m grad log pi = grad of the FORWARD KL(m || pi),
    not of the reverse KL it reports (a known property; see the enumeration tests)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def forward_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Forward KL(m || pi) from on-policy samples, with r = m / pi.
    VALUE: r log r - r + 1 >= 0, unbiased for sum m log(m/pi) - sum m + 1 (= KL(m||pi) for normalised m).
    GRADIENT: that of -stopgrad(r) log pi, i.e. -sum m grad log pi = grad KL(m || pi). The pathwise
    gradient of the value estimator (-r log r grad log pi) would be wrong, so it is not used."""
    log_r = ref_logp - logp
    r = torch.exp(log_r)
    value = r * log_r - r + 1
    surrogate = -r.detach() * logp
    return value.detach() + (surrogate - surrogate.detach())


@dataclass(frozen=True)
class ReverseKL:
    """beta * KL~(pi || q pi_ref): GRPO's leash (q == 1) or SAGE's shaped leash (any guide).

    ``importance_weighted``: multiply the per-token term by the (differentiable) ratio pi / pi_old, as TRL
    1.16 does by default (``use_bias_correction_kl``, DeepSeek-V3.2). Its value on-policy is unchanged, its
    gradient becomes E[log(pi/m) grad log pi], the true reverse-KL gradient even for k3. The paper's loss
    (and our default) is the plain term."""

    beta: float
    estimator: Literal["k1", "k2", "k3"] = "k3"
    importance_weighted: bool = False
    level: ClassVar[str] = "token"

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(
                f"divergence.beta must be > 0 for reverse_kl (got {self.beta}); use divergence=none"
            )
        if self.estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"divergence.estimator must be one of k1, k2, k3 (got {self.estimator!r})")
        if self.importance_weighted and self.estimator == "k2":
            # grad of (pi/pi_old) * 0.5 log^2(pi/m) = log(pi/m) grad log pi + 0.5 log^2(pi/m) grad log pi:
            # the second term is a bias, not the reverse-KL gradient that weighting is meant to give
            raise ValueError(
                "divergence.estimator=k2 with divergence.importance_weighted=true has a biased gradient "
                "(an extra 0.5 log^2(pi/m) grad log pi term); use k2 unweighted (its gradient is already the "
                "reverse KL's) or k3 weighted"
            )

    def per_token(self, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        match self.estimator:
            case "k1":
                return k1(logp, ref_logp)
            case "k2":
                return k2(logp, ref_logp)
            case _:
                return k3(logp, ref_logp)


def sequence_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The reverse pseudo-KL between whole completions, KL~(pi || m) with m(y) = pi_ref(y) * prod_t q_t:
    (B, T) log-probs and mask -> (B,).
    VALUE: log pi(y) - log m(y) = sum_t (log pi_t - log m_t), unbiased for sum_y pi log(pi/m) (the
    pseudo-KL less its constant 1 - sum m).
    GRADIENT: that of stopgrad(log pi(y)/m(y)) * log pi(y), i.e. E[log(pi/m) grad log pi] = grad KL~(pi||m)
    exactly (E[grad log pi] = 0). Per token, k3's gradient at a position is -sum_v q(v) pi_ref(v) grad
    log pi(v): when q_t does not depend on the token v (the branch guide's entropy gate, the random guide's
    noise) that is q_t times the pull towards pi_ref itself, a per-position strength, and the target stays
    pi_ref. Here log q enters the return of the whole completion, so a guide that fires after one choice
    makes that choice's completions more likely (tests/test_divergences.py checks both by exact
    enumeration). Its size is a whole completion's: about |y| per-token KLs; ``sequence_kl_shares`` is
    what the trainer aggregates."""
    log_ratio = ((logp - ref_logp) * mask).sum(-1)
    surrogate = log_ratio.detach() * (logp * mask).sum(-1)
    return log_ratio.detach() + (surrogate - surrogate.detach())


def sequence_kl_shares(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sequence_kl`` spread over its completion's tokens: (B, T), each unmasked token carrying
    VALUE log(pi(y)/m(y)) / |y| and GRADIENT that of stopgrad(log(pi(y)/m(y))) * log pi_t, so a
    completion's shares sum to ``sequence_kl``'s value and gradient (masked tokens carry 0).
    Aggregated by the loss type's rule (``sage.objective.aggregation.aggregate``) like TRL's policy-gradient
    term, each completion's anchor gets the weight its policy-gradient term gets: 1/|y| under grpo (the
    mean over its tokens), 1/(the batch's tokens) under bnpo and dapo, 1/(B * max length) under dr_grpo.
    So beta is per token, as for ``reverse_kl``: a completion's anchor is its per-token mean log-ratio,
    where undivided it pulled about |y| times harder than reverse_kl at the same beta."""
    log_ratio = ((logp - ref_logp) * mask).sum(-1, keepdim=True)  # (B, 1): log pi(y) - log m(y)
    length = mask.sum(-1, keepdim=True).clamp(min=1.0)
    value = (log_ratio / length).expand_as(logp)
    surrogate = log_ratio.detach() * logp
    return (value.detach() + (surrogate - surrogate.detach())) * mask


@dataclass(frozen=True)
class SequenceKL:
    """beta * KL~(pi || q pi_ref) over whole completions, per token (``sequence_kl_shares``): log q in the
    return of the whole completion, and each completion's term weighted as TRL weighs its policy-gradient
    term, so that beta pulls with reverse_kl's strength at the same beta (tests/test_divergences.py
    measures both by exact expectation).

    Its stationary point under TRL's loss is not the paper's pi ∝ q pi_ref exp(r/beta). With weight w(y)
    on both a completion's policy-gradient term (advantage A) and its anchor, a softmax policy over
    completions is stationary where w(y) (E[A|y] - beta log(pi(y)/m(y))) is the same for every y, i.e.

        log pi(y) = log(q pi_ref)(y) + E[A|y] / beta - c |y|    (grpo, w = 1/|y|)
        log pi(y) = log(q pi_ref)(y) + E[A|y] / beta - c        (bnpo, dapo, dr_grpo: w the same for all y)

    with c fixed by normalisation (under grpo a per-token constant, which favours shorter completions when
    c > 0 and longer ones when c < 0). A is GRPO's group advantage, (r - mean) / std over the group, so
    E[A|y] is r rescaled by the group's spread, not r: the reward's temperature is beta times that
    spread, not beta. The q factor is exact whatever the advantages: a guide multiplies each completion's
    probability by q(y). (Undivided, as before, it was log pi = log(q pi_ref) + E[A|y] / (beta |y|) + c
    under grpo.) On-policy (its gradient assumes the completions were sampled from pi: ``num_iterations``
    1)."""

    beta: float
    importance_weighted: ClassVar[bool] = False
    level: ClassVar[str] = "sequence"

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(
                f"divergence.beta must be > 0 for sequence_kl (got {self.beta}); use divergence=none"
            )

    def per_token(self, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return sequence_kl_shares(logp, ref_logp, mask)


@dataclass(frozen=True)
class ForwardKL:
    """beta * KL(q pi_ref || pi): mass-covering anchor (the paper's 'GRPO + forward KL' baseline)."""

    beta: float
    importance_weighted: ClassVar[bool] = False
    level: ClassVar[str] = "token"

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(
                f"divergence.beta must be > 0 for forward_kl (got {self.beta}); use divergence=none"
            )

    def per_token(self, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        return forward_kl(logp, ref_logp)


@dataclass(frozen=True)
class NoDivergence:
    """No anchor ('GRPO w/o KL'). TRL then loads no reference model, so KL-to-reference is not logged."""

    beta: float = 0.0
    importance_weighted: ClassVar[bool] = False
    level: ClassVar[str] = "token"

    def __post_init__(self) -> None:
        if self.beta != 0:
            raise ValueError(f"divergence.beta must be 0 for divergence=none (got {self.beta})")

    def per_token(self, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("divergence=none has no per-token term; the trainer must not call it")

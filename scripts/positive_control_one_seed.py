# power at 8 seeds per arm when the oracle arm has one pilot seed: the normal approximation of
# scripts/positive_control.py with the oracle's seed SD set to GRPO's (its own cannot be measured on one seed)
import math
import sys
from pathlib import Path

import numpy as np
from scipy import special

sys.path.insert(0, "scripts")
sys.path.insert(0, ".")
import positive_control as pc

from analysis import bootstrap

root = Path("outputs/positive_control/pilot")
runs = [r for f in sorted(root.iterdir()) if (r := pc.load_run(f, "arith_tail"))]
_, ref = pc.arm(runs, "grpo", "share")
_, m = pc.arm(runs, "grpo_fork_rare", "share")
d = float(m.mean() - ref.mean())
noise = bootstrap.seed_noise(ref)
run_sd = math.sqrt(noise.run_var)
print(
    f"GRPO seeds {len(ref)}: run means {np.round(ref.mean(axis=1), 4).tolist()}, run SD {run_sd:.4f}, "
    f"sampling part sqrt(resid/P) {math.sqrt(noise.resid_var / ref.shape[1]):.4f}"
)
print(f"oracle seeds {len(m)}: run mean {m.mean():.4f}; difference of means {d:+.4f}")
# per-problem gain spread less sampling noise (oracle's residual taken as GRPO's)
spread = float((m.mean(0) - ref.mean(0)).var(ddof=1))
alpha = max(0.0, spread - noise.resid_var / len(m) - noise.resid_var / len(ref))
P = ref.shape[1]
for label, sd in [
    ("oracle's run SD = GRPO's", run_sd),
    ("run SD 0.002 (study's largest)", 0.002),
    ("run SD 0.005", 0.005),
    ("run SD 0.010", 0.010),
]:
    parts = [2 * sd**2 / 8, alpha / P]
    crit = bootstrap.critical(parts, [7, P - 1], 0.05)
    se = math.sqrt(sum(parts))
    power = special.ndtr(abs(d) / se - crit) + special.ndtr(-abs(d) / se - crit)
    iv = bootstrap.t_interval(d, parts, [7, P - 1])
    print(f"8 seeds, {label}: se {se:.4f}, critical {crit:.3f}, power {power:.4f}, detectable {iv.mde:.4f}")
# the run SD per arm at which power falls to 80%: the detectable difference equals d
lo, hi = 1e-5, 1.0
for _ in range(60):
    mid = (lo + hi) / 2
    mde = bootstrap.t_interval(d, [2 * mid**2 / 8, alpha / P], [7, P - 1]).mde
    lo, hi = (mid, hi) if mde < abs(d) else (lo, mid)
print(f"power falls to 80% at a run SD of {lo:.4f} per arm (problem part sigma_alpha^2 {alpha:.2e})")

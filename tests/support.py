"""Helpers the tests share (imported as ``support``, never from another test module): the entry points run
as a user types them, the smallest real run's overrides, a composed config, what a refusal must print, the
compact decoder's check against a model's forward pass, a grid logged to MLflow without training, and a
results page rebuilt by its make target into another folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import prefork

REPO = Path(__file__).resolve().parents[1]
# A real testbed run, as small as it goes
TINY = [
    *("trl.per_device_train_batch_size=4", "trl.num_generations=2"),  # 2 prompts x 2 completions a step
    *("eval.n_samples=2", "eval.ks=[1,2]", "eval.limit=4"),  # 4 held-out problems x 2 samples
]


def compose(*overrides: str):
    """sage-train's config composed with ``overrides``, as Hydra gives it to the entry point."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from sage.config import register_configs

    register_configs()

    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        return hydra_compose("train", overrides=list(overrides))


def env_for(uri: str) -> dict[str, str]:
    """The environment of a run that logs to ``uri``, on one torch thread."""
    return {"MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1"}


def sage_train(*overrides: str, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    return entry_point("sage.train", *overrides, env=env, **kw)


def sage_eval(*overrides: str, **kw) -> subprocess.CompletedProcess:
    return entry_point("sage.eval", *overrides, **kw)


def entry_point(
    module: str,
    *overrides: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: int = 300,
) -> subprocess.CompletedProcess:
    return prefork.run(
        [sys.executable, "-m", module, *overrides],
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


def as_foreground() -> None:
    """``preexec_fn`` of a child a test interrupts: SIGINT and SIGTERM unblocked and at their default, as
    for a command typed at a terminal, whatever the test worker's own state. An ignored or blocked signal is
    inherited across exec; under xdist a child once ran a whole evaluation through the test's Ctrl-C."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM])
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    """The whole stderr of a refused command: exit code 2 and exactly one line, returned."""
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


def only_hydra_files(run_dir: Path) -> bool:
    """Nothing of the run itself: at most the run files Hydra writes into output_dir before the task."""
    return not run_dir.exists() or {p.name for p in run_dir.iterdir()} <= {".hydra", "main.log"}


ATOL = 1e-4  # of the compact decoder's logits against the model's forward pass


def check_teacher_forcing(model, prompts, copies, *, n_steps=9, drops=None, seed=0, attention="kernel"):
    """Prefill ``prompts`` (copies[i] rows each), feed random tokens (different in every row) through
    ``step``, dropping rows with ``DecodeState.select`` before the steps named in ``drops`` ({step: kept
    batch indices}); every logits row must equal the model's forward pass over that row's unpadded
    sequence, at the matching position."""
    import torch

    from sage.eval.decode import CompactDecoder

    drops = drops or {}
    decoder = CompactDecoder(model, attention=attention)
    assert decoder.attention == attention
    width, total = max(map(len, prompts)), sum(copies)
    cache = decoder.cache(width + n_steps, total + 2)  # larger than needed, as the evaluator's reused one
    for buf in (*cache.keys, *cache.values):
        buf.fill_(float("nan"))  # reading a slot never written would poison the logits
    state, logits = decoder.prefill(prompts, copies, cache, n_steps, pad_id=0)
    assert state.padded == (len(set(map(len, prompts))) > 1)
    prompt_of = [i for i, c in enumerate(copies) for _ in range(c)]
    sequences = [list(prompts[i]) for i in prompt_of]
    got = [[row] for row in logits]  # per output row: logits after each of its prefixes
    alive = list(range(total))  # batch row -> output row
    g = torch.Generator().manual_seed(seed)
    for t in range(n_steps - 1):
        if t in drops:
            state.select(torch.tensor(drops[t]))
            alive = [alive[k] for k in drops[t]]
        ids = torch.randint(model.config.vocab_size, (len(alive),), generator=g)
        for r, i in zip(alive, ids.tolist(), strict=True):
            sequences[r].append(i)
        logits = decoder.step(state, ids)
        assert logits.shape == (len(alive), model.config.vocab_size)
        for r, row in zip(alive, logits, strict=True):
            got[r].append(row)
    spread = []
    for r, seq in enumerate(sequences):
        with torch.no_grad():
            expected = model(torch.tensor([seq])).logits[0, len(prompts[prompt_of[r]]) - 1 :]
        torch.testing.assert_close(torch.stack(got[r]), expected, atol=ATOL, rtol=1e-4, msg=f"row {r}")
        spread.append(expected.std().item())
    # the comparison discriminates: logits vary far more than the tolerance
    assert min(spread) > 1000 * ATOL
    return sequences


def log_grid(uri: str, root: Path, experiment: str, extra: tuple[str, ...] = ()) -> str:
    """A grid as sage's launcher logs it, without the training: a parent run, then two methods x two seeds
    whose runs log base and trained evaluations (two evaluation seeds, 6 problems x 4 samples) through
    sage's own start_run and log_eval; the parent is closed with the grid's report. Returns its id."""
    import numpy as np

    from sage.grid import close_parent, grid_key, open_parent
    from sage.metrics import pass_at_k_over_seeds
    from sage.tracking import start_run

    where = [f"tracking.uri={uri}", f"tracking.experiment={experiment}"]
    parent = open_parent(compose(*where).tracking, grid_key(root / "sweep"), name="grid-sweep")
    rng = np.random.default_rng(0)
    rows = [{"problem": f"{i}+1?", "answer": str(i + 1)} for i in range(6)]
    for method in ("grpo", "grpo_branch"):
        for seed in (0, 1):
            cfg = compose(
                f"experiment={method}",
                f"seed={seed}",
                *where,
                f"tracking.parent_run_id={parent}",
                "tracking.name_keys=[experiment,seed]",
                "eval.ks=[1,4]",
                *extra,
            )
            out = root / f"{method}-{seed}"
            out.mkdir(parents=True)
            with start_run(cfg, out, kind="train") as tracker:
                tracker.set_tag("base_model", "base")
                for label, p, step in (("base", 0.3, 0), ("trained", 0.5 + 0.1 * (method != "grpo"), 2)):
                    correct = [rng.random((6, 4)) < p for _ in range(2)]
                    result = {
                        "summary": pass_at_k_over_seeds(correct, [1, 4]),
                        "correct": correct,
                        "completions": [[["<SOLUTION>1</SOLUTION>"] * 4] * 6] * 2,
                    }
                    tracker.log_eval(label, "arith_heldout", result, [1, 4], 2, step=step, rows=rows)
    close_parent(compose(*where).tracking, parent, ok=True)
    return parent


def rebuild_results(target: str, results: Path) -> None:
    """``make <target> RESULTS=<results>``: a study's report target writing into ``results`` (a copy of
    the committed data files under ``results/data``) instead of docs/results, as a fresh clone rebuilds it."""
    subprocess.run(
        ["make", "--no-print-directory", target, f"RESULTS={results}"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    )

"""One evaluation path (issue 42): a run's in-run final evaluation and `sage-eval` on its `final/`, given the
same problems, samples, seeds and backend, store the same cells, byte for byte.

The fair test's second held-out draw went through `sage-eval` on `final/` and gave GRPO - base +0.049, where
the study's in-run draw gave +0.019 for the same models; this test is the check that the two paths cannot be
what differs. It runs the conditions of that study that touch the evaluation: the fork world's two datasets
(`model=tiny_fork`), training rollouts from the evaluator's own sampler (`rollout=fast`), a periodic
evaluation on the model being trained before the final one, cells of several separately seeded blocks, and
two evaluation seeds."""

from __future__ import annotations

import json

import pytest
from support import REPO, TINY, compose, env_for, sage_eval, sage_train

from sage.eval.cells import BLOCK_SEQUENCES, CELL_FILES
from sage.eval.evaluate import problem_blocks

DATASETS = ("arith_heldout", "arith_tail")  # model=tiny_fork's eval group (eval=arith_fork)
N_SAMPLES, LIMIT = 24, 48
# 48 problems x 24 samples = 1152 sequences: two blocks per cell, each drawn from a seed of its own
EVAL = [f"eval.n_samples={N_SAMPLES}", f"eval.ks=[1,{N_SAMPLES}]", f"eval.limit={LIMIT}", "eval.seeds=[0,1]"]
TRAIN = [o for o in TINY if o.startswith("trl.")]  # the smallest real run; its eval keys replaced by EVAL


def cell_files(results_dir) -> dict[str, bytes]:
    """Every file of every cell under ``results_dir`` (``<dataset>/<key>_seed<s>/``), by content."""
    return {
        str(p.relative_to(results_dir)): p.read_bytes()
        for ds in DATASETS
        for cell in (results_dir / ds).iterdir()
        if cell.is_dir()  # beside each cell, the lock file of its claim
        for p in cell.iterdir()
    }


# The fair test's runs (the Makefile's FORK_ARGS for one GRPO job) and its second draw's sage-eval command
# (docs/results/fork_reading.md)
STUDY_RUN = [
    "hparams_search=fork", "experiment=grpo", "model=tiny_fork", "seed=1", "rollout=fast", "regime=anchored",
    "trl.learning_rate=1e-4", "eval.n_samples=256", "eval.every_steps=50",
    "eval.datasets.arith_heldout.n=100", "eval.datasets.arith_tail.n=100",
]  # fmt: skip
SECOND_DRAW = [
    "model=tiny_fork", "+eval.datasets.arith_heldout.seed=1", "eval.datasets.arith_heldout.n=100",
    "~eval.datasets.arith_tail", "eval.n_samples=64", "checkpoint=final",
]  # fmt: skip


def sampling(cfg) -> dict:
    """What a cell's samples depend on besides the checkpoint, rows and n (``sage.eval.cells.CellKey``)."""
    e = cfg.eval
    return {
        "temperature": e.temperature, "top_p": e.top_p, "seeds": list(e.seeds), "backend": str(e.backend),
        "max_new_tokens": e.max_new_tokens or cfg.model.max_completion_length, "dtype": str(cfg.model.dtype),
        "chat": cfg.model.chat, "batch_size": e.batch_size,
    }  # fmt: skip


def test_the_second_draw_sampled_as_the_study_did_but_for_its_problems_and_sample_count():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from sage.eval.main import register_evaluate_configs

    study = compose(*STUDY_RUN)
    register_evaluate_configs()
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        second = hydra_compose("evaluate", overrides=SECOND_DRAW)
    assert sampling(second) == sampling(study)
    assert sampling(study) == {
        "temperature": 1.0, "top_p": 1.0, "seeds": [0], "backend": "hf", "max_new_tokens": 64,
        "dtype": "float32", "chat": False, "batch_size": 2560,
    }  # fmt: skip
    assert (study.eval.n_samples, second.eval.n_samples) == (256, 64)
    first_rows, second_rows = (cfg.eval.datasets.arith_heldout for cfg in (study, second))
    assert (first_rows.n, first_rows.get("seed", 0), second_rows.n, second_rows.seed) == (100, 0, 100, 1)


@pytest.mark.slow
def test_the_in_run_evaluation_and_sage_eval_of_final_store_the_same_cells(tmp_path):
    assert len(problem_blocks(LIMIT, N_SAMPLES)) == 2 and LIMIT * N_SAMPLES > BLOCK_SEQUENCES
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = tmp_path / "run"
    r = sage_train(
        *TRAIN, "trl.max_steps=2", "model=tiny_fork", "rollout=fast", "eval.every_steps=1", *EVAL,
        f"output_dir={run}", env=env_for(uri), timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(json.loads((run / "periodic_eval.json").read_text())) == 2 * len(DATASETS)  # steps 1 and 2
    # what a user types to evaluate a run's final model again, into a fresh folder: nothing is reused
    again = tmp_path / "again"
    r = sage_eval(f"checkpoint={run / 'final'}", "model=tiny_fork", *EVAL, f"output_dir={again}",
                  env=env_for(uri), timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]

    in_run, by_sage_eval = cell_files(run / "eval" / "trained"), cell_files(again)
    # the same cell keys (checkpoint files, settings, template, backend, dtype, rows), two seeds per dataset
    assert sorted(in_run) == sorted(by_sage_eval)
    assert len({name.rsplit("/", 1)[0] for name in in_run}) == 2 * len(DATASETS)
    assert {name.rsplit("/", 1)[1] for name in in_run} == {*CELL_FILES, "meta.json"}
    for name, content in in_run.items():  # samples, correctness and pass@k curve, bit for bit
        assert by_sage_eval[name] == content, name
    results = [
        json.loads((d / "results.json").read_text())["datasets"] for d in (run / "eval" / "trained", again)
    ]
    assert results[0] == results[1]
    held_out = results[0]["arith_heldout"]["summary"]["pass@1"]
    assert 0 < held_out < 1  # a comparison of samples that differ, not of all-wrong or all-right cells

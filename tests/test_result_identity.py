"""A result is what its config, its data and its store say it is (issue 41): a folder without checkpoints,
changed rows, a re-evaluation and a resumed study never mislabel a number, and a refusal writes nothing.

Each case was first reproduced against the code before the fix (see the issue for what each printed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from evaluator_fakes import ROWS, run  # the evaluator's rows (its fixtures checkpoint and sampler: conftest)
from omegaconf import OmegaConf
from support import TINY, as_foreground, compose, env_for, one_line_error, sage_train

from sage.config import ConfigError
from sage.run_folder import IDENTITY_FILE, check_identity


def files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (Hydra's record included) but the log, by content."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()
            and p.name != "main.log"}  # fmt: skip


# ------------------------------------------------------------------ 1. identity whatever `resume` says
def test_a_folder_with_a_model_but_no_recorded_config_is_refused(tmp_path):
    (tmp_path / "final").mkdir()
    with pytest.raises(ConfigError) as e:
        check_identity(compose("seed=2"), tmp_path)
    assert str(e.value) == (
        f"output_dir={tmp_path} holds a run (final) but neither identity.json nor config.yaml, so its "
        "config is unknown: choose another output_dir"
    )
    check_identity(compose("seed=2"), tmp_path / "empty")  # nothing of a run: any config starts there


@pytest.fixture(scope="module")
def no_checkpoints(tmp_path_factory):
    """A finished 1-step run that saved no checkpoint (trl.save_strategy=no), at seed 1."""
    root = tmp_path_factory.mktemp("no_checkpoints")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    run = root / "ns"
    r = sage_train(
        *TINY, "trl.max_steps=1", "trl.save_strategy=no", "seed=1", f"output_dir={run}", env=env_for(uri),
        timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert not list((run / "rl").glob("checkpoint-*"))
    return {"root": root, "uri": uri, "run": run}


def copy_of(fixture, name: str) -> Path:
    dst = fixture["root"] / name
    shutil.copytree(fixture["run"], dst)
    return dst


def train_run_tags(uri: str) -> list[dict[str, str]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("sage")
    return [r.data.tags for r in client.search_runs([exp.experiment_id])] if exp else []


@pytest.mark.slow
@pytest.mark.parametrize("drop_rl", [False, True], ids=["as-left", "rl-removed"])
def test_a_finished_folder_without_checkpoints_refuses_another_config(no_checkpoints, drop_rl):
    """`seed=2 guide=branch` into a finished seed-1 GRPO folder without checkpoints (or whose rl/ was
    removed to save disk) once skipped RL and reported the old model under seed 2 + Branch."""
    run = copy_of(no_checkpoints, f"other_{drop_rl}")
    if drop_rl:
        shutil.rmtree(run / "rl")
    before = files(run)
    r = sage_train(*TINY, "trl.max_steps=1", "trl.save_strategy=no", "seed=2", "guide=branch",
                   f"output_dir={run}", env=env_for(no_checkpoints["uri"]))  # fmt: skip
    line = one_line_error(r)
    assert line.startswith(f"error: output_dir={run} holds a run of another config: ")
    assert "seed=2 (the folder's: 1)" in line and "guide._target_=" in line
    assert files(run) == before  # config.yaml, identity.json, the model: all the seed-1 run's
    assert OmegaConf.load(run / "config.yaml").seed == 1
    assert json.loads((run / IDENTITY_FILE).read_text())["seed"] == 1
    for tags in train_run_tags(no_checkpoints["uri"]):  # the seed-1 run took no other config
        assert not [k for k in tags if k.startswith("resumed.")], tags


# ------------------------------------------------------------------ 5. a refusal writes nothing
@pytest.mark.slow
def test_a_refused_resume_leaves_hydras_record_of_the_folder(no_checkpoints):
    run = copy_of(no_checkpoints, "refused")
    record = {name: (run / ".hydra" / name).read_bytes() for name in ("config.yaml", "hydra.yaml",
                                                                     "overrides.yaml")}  # fmt: skip
    before = files(run)
    r = sage_train(*TINY, "resume=true", "seed=7", "guide=branch", f"output_dir={run}",
                   env=env_for(no_checkpoints["uri"]))  # fmt: skip
    assert "holds a run of another config" in one_line_error(r)
    assert {name: (run / ".hydra" / name).read_bytes() for name in record} == record
    assert files(run) == before
    # a refused run into a new folder leaves no Hydra record there either
    fresh = no_checkpoints["root"] / "fresh"
    r = sage_train("resume=true", f"output_dir={fresh}", env=env_for(no_checkpoints["uri"]))
    assert "holds no checkpoint" in one_line_error(r)
    assert not (fresh / ".hydra").exists()


# ------------------------------------------------------------------ 2 + 6. cells keyed by content, checked
def cells_of(results_dir: Path, dataset: str) -> list[Path]:
    return sorted(p for p in (results_dir / dataset).iterdir() if not p.name.startswith("."))


def test_rows_rewritten_under_the_same_ids_are_sampled_again(checkpoint, sampler, tmp_path):
    """Every problem and gold answer rewritten, the ids kept: the old cells' numbers were reported."""
    first = run(checkpoint, tmp_path / "res")
    assert len(sampler.calls) == 4
    rewritten = {
        name: [{**r, "problem": f"({r['problem']})", "answer": f"{r['answer']}0"} for r in rows]
        for name, rows in ROWS.items()
    }
    again = run(checkpoint, tmp_path / "res", rows=rewritten)
    assert len(sampler.calls) == 8  # every cell sampled on the new rows
    assert len(cells_of(tmp_path / "res", "a")) == 4  # the old rows' cells are kept beside, never reused
    only_answer = {name: [{**r, "answer": "7"} for r in rows] for name, rows in ROWS.items()}
    run(checkpoint, tmp_path / "res", rows=only_answer)  # a gold answer alone changes what is graded
    assert len(sampler.calls) == 12
    assert again["a"]["summary"] == first["a"]["summary"]  # the fake grades RIGHT against any gold


@pytest.mark.parametrize("damage", ["all-true", "truncated", "corrupt-meta", "completions"])
def test_a_damaged_or_edited_cell_is_set_aside_named_and_sampled_again(
    checkpoint, sampler, tmp_path, caplog, damage
):
    first = run(checkpoint, tmp_path / "res")
    cell = cells_of(tmp_path / "res", "a")[0]
    correct = np.load(cell / "correct.npy")
    assert not correct.all()
    if damage == "all-true":  # same shape, every sample right: pass@1 = 1.000 was reported
        np.save(cell / "correct.npy", np.ones_like(correct))
    elif damage == "truncated":
        data = (cell / "correct.npy").read_bytes()
        (cell / "correct.npy").write_bytes(data[: len(data) // 2])
    elif damage == "corrupt-meta":
        (cell / "meta.json").write_text('{"key": ')
    else:
        (cell / "completions.json").write_text(json.dumps([["x"] * 4] * 3))
    caplog.set_level("WARNING", logger="sage.eval.cells")
    again = run(checkpoint, tmp_path / "res")
    assert len(sampler.calls) == 5  # that cell alone, sampled again
    assert again["a"]["summary"] == first["a"]["summary"]
    for x, y in zip(again["a"]["correct"], first["a"]["correct"], strict=True):
        assert np.array_equal(x, y)
    aside = cell.with_name(f"{cell.name}.set-aside")
    assert aside.is_dir() and (cell / "meta.json").is_file()  # kept for inspection; a whole cell in place
    lines = [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]
    assert len(lines) == 1 and str(cell) in lines[0] and "\n" not in lines[0]


# ------------------------------------------------------------------ 3. one evaluation per (run, label)
def tracked_cfg(uri: str, n_samples: int, ks: list[int]):
    """What start_run reads of a config: the tracking node, a seed, the eval keys a resume changes."""
    from sage.config import TrackingConfig

    cfg = OmegaConf.create({"seed": 1, "method": "grpo", "eval": {"n_samples": n_samples, "ks": ks}})
    cfg.tracking = OmegaConf.structured(TrackingConfig(uri=uri, experiment="e"))
    return cfg


def evaluation(matrix: np.ndarray, ks: list[int]) -> dict:
    from sage.metrics import pass_at_k_over_seeds

    return {
        "summary": pass_at_k_over_seeds([matrix], ks),
        "correct": [matrix],
        "completions": [[["x"] * matrix.shape[1]] * matrix.shape[0]],
    }


def test_a_re_evaluation_with_other_settings_is_the_only_one_the_report_reads(tmp_path):
    """Train with eval.n_samples=4 eval.ks=[1,2,4], resume with n_samples=2 ks=[1,2] at the same step, then
    with n_samples=4 again: the report once joined pass@4 of the first evaluation to pass@1 of the second,
    and read the stale tag resumed.eval.n_samples=2 as the run's setting."""
    from mlflow.tracking import MlflowClient

    from analysis import load
    from sage.tracking import start_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "run"
    out.mkdir()
    four = np.array([[True, False, False, False], [False, False, True, True]])  # pass@1 0.375, pass@4 1
    two = np.array([[False, False], [True, False]])  # pass@1 0.25, pass@2 0.5
    for resume, (n, ks, matrix) in enumerate([(4, [1, 2, 4], four), (2, [1, 2], two)]):
        with start_run(tracked_cfg(uri, n, ks), out, kind="train", resume=bool(resume)) as tracker:
            tracker.log_eval("trained", "ds", evaluation(matrix, ks), ks, None, step=2)
            run_id = tracker.run_id
    client = MlflowClient(uri)
    runs = load.runs_frame(load.fetch_runs(client, "e"))
    table = load.eval_frame(runs).set_index("k")["value"].to_dict()
    assert table == {1: pytest.approx(0.25), 2: pytest.approx(0.5)}  # no pass@4 of the other evaluation
    curve = load.curve_frame(client, runs).set_index("k")["value"].to_dict()
    assert curve == {1: pytest.approx(0.25), 2: pytest.approx(0.5)}  # no k = 3, 4 of the first curve
    assert runs.iloc[0]["params"]["eval.n_samples"] == "2"
    with start_run(tracked_cfg(uri, 4, [1, 2, 4]), out, kind="train", resume=True):  # back to n = 4
        pass
    tags = client.get_run(run_id).data.tags
    assert not [k for k in tags if k.startswith("resumed.")]  # no stale resumed.eval.n_samples=2
    runs = load.runs_frame(load.fetch_runs(client, "e"))
    assert runs.iloc[0]["params"]["eval.n_samples"] == "4"


# ------------------------------------------------------------------ 4. an Optuna study is one experiment
def test_a_resumed_study_with_other_fixed_overrides_or_space_is_refused_in_one_line(tmp_path):
    """Resuming hparams_search=branch_threshold_ratio with trl.learning_rate=3e-4 (it was 1e-4) and
    guide.ratio=interval(0.9,1.0): new trials once trained at the new rate beside the old ones on one
    Pareto front, and a retry of an old trial ran outside the new space."""
    import optuna

    from sweeps.optuna import SageOptunaSweeper, SweepError

    def driver(study_name: str = "s") -> SageOptunaSweeper:
        return SageOptunaSweeper(
            study_name=study_name, storage=f"sqlite:///{tmp_path / 'study.db'}", n_trials=2, n_jobs=1,
            objectives=["a"], weights=None, directions=["maximize"],
            params={"guide.ratio": "interval(0.1,0.5)"}, choices_as="points", max_retries=1,
            max_failures=1, sampler=optuna.samplers.RandomSampler(seed=0), pruner=optuna.pruners.NopPruner(),
        )  # fmt: skip

    fixed = ["guide=branch", "trl.learning_rate=1e-4", "resume=auto", "tracking.experiment=x"]
    s = driver()
    space, kept = s.search_space(fixed)
    study = s.create_study(space, kept)
    trial = study.ask(space)
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    # the same experiment resumes, whatever changes no result (where it logs, resume)
    driver().create_study(*driver().search_space(["trl.learning_rate=1e-4", "guide=branch", "resume=true"]))

    other_lr = ["guide=branch", "trl.learning_rate=3e-4", "resume=auto"]
    with pytest.raises(SweepError) as e:
        driver().create_study(*driver().search_space(other_lr))
    assert str(e.value) == (
        f"study 's' in sqlite:///{tmp_path / 'study.db'} is another experiment: trl.learning_rate=0.0003 "
        "(the study's: 0.0001); resume it with its own space and overrides, or start a new study with "
        "another hydra.sweeper.study_name"
    )
    with pytest.raises(SweepError) as e:
        driver().create_study(*driver().search_space([*fixed, "guide.ratio=interval(0.9,1.0)"]))
    message = str(e.value)
    assert "\n" not in message and "guide.ratio searched over FloatDistribution(high=1.0" in message
    assert "(the study's: FloatDistribution(high=0.5" in message
    # a new study name is a new experiment
    driver("s-lr3e-4").create_study(*driver().search_space(other_lr))
    stored = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}")
    assert stored.user_attrs["sage.definition"]["fixed"] == {"guide": "branch", "trl.learning_rate": "0.0001"}


# ------------------------------------------------------------------ 8. one line, before the MLflow run
@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "divergence.beta=nan",
            "divergence.beta must be a finite number >= 0 (got nan); 0 is divergence=none",
        ),
        ("trl.learning_rate=nan", "trl.learning_rate must be a finite number > 0 (got nan)"),
        ("trl.learning_rate=-1", "trl.learning_rate must be a finite number > 0 (got -1.0)"),
    ],
    ids=["beta-nan", "lr-nan", "lr-negative"],
)
def test_a_nan_or_negative_beta_or_learning_rate_is_one_line(override, line):
    from sage.config import validate

    with pytest.raises(ConfigError) as e:
        validate(compose(override))
    assert str(e.value) == line


@pytest.mark.slow
def test_a_nan_beta_is_refused_before_the_mlflow_run_exists(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    r = sage_train("divergence.beta=nan", f"output_dir={tmp_path / 'run'}", env=env_for(uri))
    assert one_line_error(r) == (
        "error: divergence.beta must be a finite number >= 0 (got nan); 0 is divergence=none"
    )
    assert not (tmp_path / "mlflow.db").exists() or not train_run_tags(uri)  # no FAILED run left
    left = {p.name for p in (tmp_path / "run").iterdir()} if (tmp_path / "run").exists() else set()
    assert left <= {"main.log"}  # Hydra's log alone: its record (.hydra/) is taken back


@pytest.mark.slow
def test_a_folder_whose_mlflow_run_was_deleted_says_how_to_recover(no_checkpoints):
    """Every resume of such a folder once ended in MLflow's traceback, after the model was built."""
    from mlflow.tracking import MlflowClient

    from sage.tracking import RUN_ID_FILE

    run = no_checkpoints["run"]
    client = MlflowClient(no_checkpoints["uri"])
    run_id = (run / RUN_ID_FILE).read_text().strip()
    before = files(run)
    client.delete_run(run_id)
    try:
        r = sage_train(*TINY, "trl.max_steps=1", "trl.save_strategy=no", "seed=1", "resume=auto",
                       f"output_dir={run}", env=env_for(no_checkpoints["uri"]))  # fmt: skip
        assert one_line_error(r) == (
            f"error: output_dir={run} continues MLflow run {run_id}, which was deleted in "
            f"{no_checkpoints['uri']}: restore it (MLflow UI: the experiment's deleted runs -> Restore, or "
            f"`mlflow runs restore --run-id {run_id}`), or use a new output_dir"
        )
        assert files(run) == before
    finally:
        client.restore_run(run_id)


# ------------------------------------------------------------------ 7. an evaluation holds what it reads
def test_moving_a_final_model_waits_for_its_evaluation(tmp_path):
    import threading

    from sage.durable import reading
    from sage.run_folder import keep_earlier_final

    final = tmp_path / "final"
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"weights")
    with reading(final):
        mover = threading.Thread(target=keep_earlier_final, args=(final, 2))
        mover.start()
        mover.join(timeout=1.0)
        assert mover.is_alive() and (final / "model.safetensors").is_file()  # waits while it is read
    mover.join(timeout=30)
    assert not mover.is_alive() and (tmp_path / "final-step-2" / "model.safetensors").is_file()
    assert not (final / "model.safetensors").exists()
    with pytest.raises(ConfigError, match=r"checkpoint=.*/final was moved as this evaluation started"):
        with reading(final):
            pass


def test_a_moved_final_models_results_name_the_folder_it_moved_to(tmp_path):
    """results.json named .../final after the extension had moved the weights it measured away."""
    from sage.run_folder import keep_earlier_final

    final = tmp_path / "final"
    (final / "eval").mkdir(parents=True)
    measured = {"checkpoint": str(final.resolve()), "datasets": {"arith_heldout": {"n_problems": 4}}}
    (final / "eval" / "results.json").write_text(json.dumps(measured))
    kept = keep_earlier_final(final, 2)
    results = json.loads((kept / "eval" / "results.json").read_text())
    assert results == {**measured, "checkpoint": str((tmp_path / "final-step-2").resolve())}


@pytest.mark.slow
def test_sage_eval_of_final_is_not_left_without_its_files_by_an_extension(no_checkpoints):
    """The extension moved final -> final-step-N while sage-eval sampled: its results had nowhere to go, and
    its run ended FAILED with a FileNotFoundError."""
    import fcntl
    import os
    import subprocess
    import sys
    import time

    from sage.run_folder import keep_earlier_final

    run = copy_of(no_checkpoints, "read_while_extended")
    final = run / "final"
    evaluation = subprocess.Popen(
        [sys.executable, "-m", "sage.eval", f"checkpoint={final}", "eval.n_samples=2", "eval.ks=[1,2]",
         "eval.limit=4", "eval.seeds=[5]"],
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env_for(no_checkpoints["uri"])},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        held = False
        while not held and evaluation.poll() is None:  # until sage-eval holds final/ for reading
            time.sleep(0.02)
            with open(run / ".final.readers.lock", "a+") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    held = True
        assert held, "sage-eval never held the folder it reads"
        kept = keep_earlier_final(final, 1)  # what an extension does once it has trained: it waits
        # the evaluation had written its results into the folder before the folder moved
        results = json.loads((kept / "eval" / "results.json").read_text())
    finally:
        out, err = evaluation.communicate(timeout=600)
    assert evaluation.returncode == 0, err[-3000:]
    assert kept == run / "final-step-1"
    assert results["datasets"]["arith_heldout"]["n_problems"] == 4
    # sage-eval printed its results path while it held the folder, before the move; the results then name
    # the folder the weights they measured moved to
    assert f"results: {final.resolve() / 'eval' / 'results.json'}" in out
    assert results["checkpoint"] == str(kept.resolve())


# ------------------------------------------------------------------ 9. signal messages name what exists
def test_an_interruption_before_any_mlflow_run_names_no_run(capsys):
    from sage.cli import Terminated, exit_on_config_error

    def building_the_base_model(cfg):
        raise Terminated

    with pytest.raises(SystemExit) as e:
        exit_on_config_error(building_the_base_model, OmegaConf.create({}))
    assert e.value.code == 143
    assert capsys.readouterr().err.strip() == (
        "terminated (SIGTERM): no MLflow run had started and nothing was recorded; rerun the same command to "
        "start"
    )


@pytest.mark.slow
def test_sigterm_during_the_base_model_build_names_no_run_and_no_resume(tmp_path):
    """It said "the MLflow run is marked KILLED ... rerun with resume=true" with neither in existence."""
    import os
    import signal
    import subprocess
    import sys
    import time

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cache = tmp_path / "cache"  # an empty cache: the testbed model is built first
    proc = subprocess.Popen(
        [sys.executable, "-m", "sage.train", *TINY, "trl.max_steps=1", f"output_dir={tmp_path / 'run'}"],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "SAGE_CACHE_DIR": str(cache), **env_for(uri)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=as_foreground,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not list(cache.rglob(".tmp-*")):  # the base model's build has begun
            assert proc.poll() is None and time.monotonic() < deadline, "the build did not start"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "terminated (SIGTERM): no MLflow run had started and nothing was recorded; rerun the same command to "
        "start"
    )
    assert "resume=true" not in err and "KILLED" not in err
    assert not (tmp_path / "mlflow.db").exists() or not train_run_tags(uri)  # no run was made

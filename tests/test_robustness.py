"""What a kill, a rerun, a dead tracking server or a bad value or file must not do (issue 14): a checkpoint
cut short by a kill is set aside, never resumed from; a rerun that finds no checkpoint starts a new MLflow
run instead of merging into the killed one; an unreachable or corrupt store, a bad schedule, an unusable
output_dir, a damaged checkpoint folder and a bad data file each fail with one line (exit code 2) before
any model is built or anything of the run is written; a base-only run just runs. And what a run must not
print: a dict of every metric per step, repeated warnings, Hydra folders in the current folder."""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from support import as_foreground, one_line_error, only_hydra_files, sage_eval, sage_train
from transformers.trainer_utils import get_last_checkpoint

from sage.config import ConfigError
from sage.eval.checkpoint import check_checkpoint_folder
from sage.tracking import RUN_ID_FILE, open_store, start_run
from sage.train.resume import set_aside_incomplete_checkpoints


def test_a_checkpoint_cut_short_by_a_kill_is_set_aside(tmp_path):
    from safetensors.torch import save_file

    rl = tmp_path / "rl"
    done, cut = rl / "checkpoint-1", rl / "checkpoint-2"
    for folder in (done, cut):
        folder.mkdir(parents=True)
        save_file({"w": torch.ones(4)}, str(folder / "model.safetensors"))
    weights = (cut / "model.safetensors").read_bytes()
    (done / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    torch.save({"rng": 1}, done / "rng_state.pth")
    (cut / "rng_state.pth").write_bytes(b"")  # what a SIGKILL during the save left: no trainer_state.json
    set_aside_incomplete_checkpoints(rl)
    assert get_last_checkpoint(str(rl)) == str(done)
    assert (rl / "checkpoint-2.incomplete" / "model.safetensors").read_bytes() == weights  # kept
    set_aside_incomplete_checkpoints(rl)  # a second pass leaves the complete one alone
    assert done.is_dir()


def cfg(uri: str):
    from sage.config import TrackingConfig

    tracking = OmegaConf.merge(OmegaConf.structured(TrackingConfig), {"uri": uri, "experiment": "e"})
    return OmegaConf.create({"seed": 1, "tracking": tracking})


def test_a_rerun_without_a_checkpoint_starts_a_new_run(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "out"
    out.mkdir()
    try:
        with start_run(cfg(uri), out, kind="train", resume=False) as tracker:
            first = tracker.run_id
            raise KeyboardInterrupt  # Ctrl-C
    except KeyboardInterrupt:
        pass
    client = MlflowClient(uri)
    assert client.get_run(first).info.status == "KILLED"
    with start_run(cfg(uri), out, kind="train", resume=False) as tracker:
        second = tracker.run_id
    assert second != first and (out / RUN_ID_FILE).read_text() == second
    assert client.get_run(first).info.status == "KILLED"  # the earlier attempt keeps its own record
    with start_run(cfg(uri), out, kind="train", resume=True) as tracker:  # a resume continues the run
        assert tracker.run_id == second


def test_an_unreachable_or_corrupt_store_fails_in_one_line_before_any_work(tmp_path):
    start = time.monotonic()
    r = sage_train("tracking.uri=http://127.0.0.1:9", f"output_dir={tmp_path / 'a'}")
    elapsed = time.monotonic() - start
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert lines[-1].startswith("error: tracking.uri=http://127.0.0.1:9: the MLflow store cannot be opened")
    assert elapsed < 120 and only_hydra_files(tmp_path / "a")  # nothing built, nothing written

    corrupt = tmp_path / "mlflow.db"
    corrupt.write_bytes(b"this is not a database" * 100)
    r = sage_train(f"output_dir={tmp_path / 'b'}", env={"MLFLOW_TRACKING_URI": f"sqlite:///{corrupt}"})
    assert r.returncode == 2
    last = [ln for ln in r.stderr.strip().splitlines() if ln.strip()][-1]
    assert last.startswith(f"error: tracking.uri=sqlite:///{corrupt}: the MLflow store cannot be opened")
    assert only_hydra_files(tmp_path / "b")


def test_a_folder_naming_a_run_of_another_store_starts_a_new_run(tmp_path):
    """The base model's evaluation cache is shared by runs logged to different stores."""
    out = tmp_path / "shared"
    out.mkdir()
    with start_run(cfg(f"sqlite:///{tmp_path / 'a.db'}"), out, kind="eval") as tracker:
        in_a = tracker.run_id
    with start_run(cfg(f"sqlite:///{tmp_path / 'b.db'}"), out, kind="eval") as tracker:
        in_b = tracker.run_id
    assert in_b != in_a and (out / RUN_ID_FILE).read_text() == in_b


# ------------------------------------------------------------------ item 8: one line, not a traceback
def test_schedule_cycles_0_is_one_line_before_anything_runs(tmp_path):
    r = sage_train(
        "guide=token", "schedule.cycles=0", f"output_dir={tmp_path / 'a'}", "tracking.enabled=false"
    )
    assert one_line_error(r) == "error: schedule: schedule.cycles must be >= 1 (got 0)"
    assert only_hydra_files(tmp_path / "a")


@pytest.mark.slow
def test_a_base_only_run_under_the_cosine_schedule_evaluates_the_start_model(tmp_path):
    """max_steps=0 trains nothing, so the default cosine schedule has nothing to refuse. Rerun with
    resume=auto (as a grid's rerun does), the finished base row continues its MLflow run: the start model is
    not recorded twice (Table 1's base rows once were)."""
    from mlflow.tracking import MlflowClient

    out, uri = tmp_path / "base", f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = ("guide=token", "trl.max_steps=0", "eval.n_samples=2", "eval.limit=2", f"output_dir={out}")
    r = sage_train(*args, f"tracking.uri={uri}", "tracking.experiment=b")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| base | arith_heldout |" in r.stdout
    assert set(json.loads((out / "metrics.json").read_text())) >= {"pass_at_1/base/arith_heldout"}
    assert not (out / "rl").exists() and not (out / "final").exists()
    first = (out / RUN_ID_FILE).read_text()
    r = sage_train(*args, f"tracking.uri={uri}", "tracking.experiment=b", "resume=auto")
    assert r.returncode == 0, r.stderr[-3000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("b").experiment_id])
    assert run.info.run_id == first and run.info.status == "FINISHED"


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder nothing can be created in, even by root (immutable attribute), else by permissions."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    if os.geteuid() == 0:
        made = subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
    else:
        folder.chmod(0o555)
        made = True
    try:
        (folder / "probe").touch()
    except OSError:
        pass
    else:
        made = False
        (folder / "probe").unlink()
    if not made:
        pytest.skip("this machine cannot make a read-only folder")
    yield folder
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    folder.chmod(0o755)


@pytest.mark.parametrize("command", [sage_train, sage_eval])
def test_an_output_dir_that_is_a_file_or_read_only_is_one_line(command, tmp_path, read_only_dir):
    a_file = tmp_path / "a_file"
    a_file.write_text("kept")
    r = command(f"output_dir={a_file}", "tracking.enabled=false")
    assert one_line_error(r) == f"error: output_dir={a_file} is a file; give a folder (new or existing)"
    assert a_file.read_text() == "kept"

    r = command(f"output_dir={a_file / 'run'}", "tracking.enabled=false")
    assert one_line_error(r) == f"error: output_dir={a_file / 'run'} cannot be created: {a_file} is a file"

    for target in (read_only_dir, read_only_dir / "run"):
        r = command(f"output_dir={target}", "tracking.enabled=false")
        assert one_line_error(r).startswith(f"error: output_dir={target} is not writable: {read_only_dir}: ")
    assert list(read_only_dir.iterdir()) == []


def corrupt(case: str, testbed: Path, folder: Path) -> str:
    """A copy of the testbed model with one kind of damage; returns what the error must name."""
    if case == "empty":
        folder.mkdir()
        return "holds neither config.json nor adapter_config.json"
    shutil.copytree(testbed, folder)
    if case == "config":
        (folder / "config.json").write_text('{"model_type": "qwen2", ')  # a copy cut short
        return "config.json is not readable JSON"
    if case == "weights":
        with open(folder / "model.safetensors", "r+b") as f:
            f.truncate(100)
        return "weight file model.safetensors is not a readable safetensors file"
    if case == "no_weights":
        (folder / "model.safetensors").unlink()
        return "holds no weights"
    if case == "tokenizer":
        (folder / "tokenizer.json").unlink()
        return "holds no tokenizer vocabulary"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["empty", "config", "weights", "no_weights", "tokenizer"])
def test_a_damaged_checkpoint_folder_is_named(case, tmp_path, testbed_model):
    folder = tmp_path / "ckpt"
    expected = corrupt(case, testbed_model, folder)
    with pytest.raises(ConfigError) as error:
        check_checkpoint_folder(str(folder))
    assert str(error.value).startswith(f"checkpoint={folder}") and expected in str(error.value)


def test_sound_checkpoint_folders_pass(tmp_path, testbed_model):
    from safetensors.torch import save_file

    check_checkpoint_folder(str(testbed_model))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(testbed_model)}))
    save_file({"lora_A": torch.zeros(2, 2)}, adapter / "adapter_model.safetensors")
    check_checkpoint_folder(str(adapter))  # its tokenizer is its base's
    (adapter / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(tmp_path / "gone")})
    )
    with pytest.raises(ConfigError, match="the adapter's base: checkpoint=.*gone is not a folder"):
        check_checkpoint_folder(str(adapter))


@pytest.mark.parametrize("case", ["empty", "weights"])
def test_sage_eval_of_a_damaged_checkpoint_is_one_line_and_creates_nothing(case, tmp_path, testbed_model):
    """Issue 14: an empty folder gave 'install sentencepiece or tiktoken' after creating <dir>/eval and a
    FAILED MLflow run."""
    from mlflow.tracking import MlflowClient

    folder = tmp_path / "ckpt"
    expected = corrupt(case, testbed_model, folder)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _, experiment = open_store(store, "sage")  # an existing store: its creation logs nothing on stderr
    r = sage_eval(f"checkpoint={folder}", f"tracking.uri={store}", "eval.n_samples=2", "eval.limit=2")
    line = one_line_error(r)
    assert line.startswith(f"error: checkpoint={folder}") and expected in line
    assert not (folder / "eval").exists()
    assert MlflowClient(store).search_runs([experiment], run_view_type=3) == []  # 3: active and deleted


def bad_data(tmp_path: Path) -> tuple[Path, Path]:
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text('{"prompt": "1+1", "solution": "2"}\n\n{"prompt": "2+2", "solution": \n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    return malformed, empty


@pytest.mark.parametrize("kind", ["malformed", "empty"])
def test_a_bad_training_data_file_is_one_line_naming_file_and_line(kind, tmp_path):
    malformed, empty = bad_data(tmp_path)
    source = malformed if kind == "malformed" else empty
    r = sage_train(
        "data=dapo_math_17k",
        f"data.source={source}",
        f"output_dir={tmp_path / 'a'}",
        "tracking.enabled=false",
    )
    expected = {
        "malformed": f"{malformed}: line 3: invalid JSON (Expecting value)",
        "empty": f"data source '{empty}' holds no rows",
    }[kind]
    assert one_line_error(r) == f"error: sage.data.datasets.math_prompts: {expected}"
    assert only_hydra_files(tmp_path / "a")


def test_an_empty_benchmark_file_is_one_line_before_training(tmp_path):
    """It used to give zero rows, found only by the evaluation after training had finished."""
    _, empty = bad_data(tmp_path)
    r = sage_train(
        "eval=aime24",
        f"eval.datasets.aime24.source={empty}",
        f"output_dir={tmp_path / 'a'}",
        "tracking.enabled=false",
    )
    assert one_line_error(r) == f"error: sage.data.benchmarks.load_benchmark: {empty}: holds no rows"
    assert only_hydra_files(tmp_path / "a")


NOT_UTF8 = (
    "byte 0xe9 (at byte {at} of the file) is not UTF-8 (invalid continuation byte); save the file as UTF-8"
)


@pytest.mark.parametrize("suffix", ["jsonl", "json"])
def test_a_byte_that_is_not_utf8_in_a_benchmark_file_is_one_line_naming_file_and_row(suffix, tmp_path):
    """Issue 47: Python's decoding error named neither the file nor the row."""
    rows = [
        b'{"id": 1, "problem": "1+1?", "answer": "2"}',
        b'{"id": 2, "problem": "caf\xe9?", "answer": "3"}',
    ]
    data = tmp_path / f"aime24.{suffix}"
    data.write_bytes(b"\n".join(rows) + b"\n" if suffix == "jsonl" else b"[" + b",\n".join(rows) + b"]")
    at = data.read_bytes().index(b"\xe9")
    r = sage_eval("eval=aime24", f"eval.datasets.aime24.source={data}", "tracking.enabled=false")
    expected = f"{data}: row 2: {NOT_UTF8.format(at=at)}"
    assert one_line_error(r) == f"error: sage.data.benchmarks.load_benchmark: {expected}"


def test_a_byte_that_is_not_utf8_in_a_training_data_file_is_one_line_naming_file_and_row(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_bytes(b'{"prompt": "1+1", "solution": "2"}\n{"prompt": "caf\xe9", "solution": "2"}\n')
    at = data.read_bytes().index(b"\xe9")
    r = sage_train(
        "data=dapo_math_17k", f"data.source={data}", f"output_dir={tmp_path / 'a'}", "tracking.enabled=false"
    )
    expected = f"{data}: row 2: {NOT_UTF8.format(at=at)}"
    assert one_line_error(r) == f"error: sage.data.datasets.math_prompts: {expected}"
    assert only_hydra_files(tmp_path / "a")


# ---------------------------------------------------------------------------------------- item 9: noise
@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """One short sage-train run from a folder of its own, with output_dir given."""
    root = tmp_path_factory.mktemp("short_run")
    cwd = root / "cwd"
    cwd.mkdir()
    out = root / "run"
    store = f"sqlite:///{root / 'mlflow.db'}"
    open_store(store, "sage")  # an existing store: its creation logs nothing on stderr
    r = sage_train(
        "trl.max_steps=2",
        "trl.per_device_train_batch_size=16",
        "trl.num_generations=4",
        "eval.n_samples=4",
        "eval.limit=5",
        f"output_dir={out}",
        f"tracking.uri={store}",
        cwd=cwd,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return r, cwd, out, store


@pytest.mark.slow
def test_hydra_writes_its_run_files_inside_output_dir(short_run):
    _, cwd, out, _ = short_run
    assert list(cwd.iterdir()) == []  # no outputs/<date>/<time>/ in the current folder
    assert (out / ".hydra" / "overrides.yaml").is_file() and (out / "main.log").is_file()


@pytest.mark.slow
def test_each_step_prints_one_short_line_and_mlflow_keeps_every_metric(short_run):
    from mlflow.tracking import MlflowClient

    r, _, out, store = short_run
    assert "{'loss'" not in r.stdout  # transformers' dict of every metric (about 900 characters a step)
    steps = re.findall(r"^step (\d+)/2: loss .*$", r.stdout, flags=re.MULTILINE)
    assert steps == ["1", "2"], r.stdout
    assert all(len(line) < 120 for line in r.stdout.splitlines() if line.startswith("step "))
    client = MlflowClient(store)
    run_id = (out / RUN_ID_FILE).read_text()
    logged = client.get_run(run_id).data.metrics
    for key in ("loss", "reward", "kl", "entropy", "grad_norm", "learning_rate", "completions/mean_length"):
        assert [m.step for m in client.get_metric_history(run_id, f"train/{key}")] == [1, 2], key
    assert len([k for k in logged if k.startswith("train/")]) >= 25


@pytest.mark.slow
def test_no_warning_is_repeated_and_the_evaluation_shows_progress(short_run):
    r, *_ = short_run
    stderr = r.stderr.replace("\r", "\n")
    warnings = collections.Counter(re.findall(r"(\w+Warning): (.*)", stderr))
    assert not [w for w, n in warnings.items() if n > 1], warnings
    assert not [w for w, _ in warnings if w == "FutureWarning"], warnings
    assert re.search(r"eval arith_heldout: 100%.* 20/20", stderr)  # 5 problems x 4 samples, a bar each


@pytest.mark.slow
def test_ctrl_c_during_training_is_one_line_and_the_run_is_killed(tmp_path):
    """A real SIGINT once training has started: exit code 130, one line on what was kept after the progress
    output (no traceback), and the MLflow run closed KILLED."""
    import signal
    import time

    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sage.train", "trl.max_steps=200", f"output_dir={tmp_path / 'run'}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_TRACKING_URI": uri},
        preexec_fn=as_foreground,
    )
    try:
        deadline = time.monotonic() + 600
        for line in proc.stdout:  # the console prints one line per optimiser step
            if line.startswith("step 2/") or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted (Ctrl-C): the MLflow run is marked KILLED")
    # issue 47: no checkpoint yet (trl.save_steps 50), so resume=true, which would be refused, is not offered
    assert f"no checkpoint was saved in {(tmp_path / 'run').resolve()}" in last, last
    assert "a rerun starts over" in last and "resume=true" not in last
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("sage").experiment_id])
    assert run.info.status == "KILLED"

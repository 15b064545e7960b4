"""Faults and bad values of issue 23, each reproduced as a user meets it: sampling and trainer values that
ran silently wrong (a negative temperature, max_new_tokens=0 meaning the model's length, repeated eval
seeds, max_steps=-1 under a GRPO tag) or crashed late; a tracking server that accepts connections but never
answers; SIGTERM as SLURM sends it; a prompt format that does not match the checkpoint; a corrupt report
store and a --seeds that matches no run; a full disk; a run shortened on resume. Each is one line."""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import prefork
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from support import as_foreground, only_hydra_files

from sage.cli import exit_on_config_error, full_disk
from sage.config import ConfigError, check_eval, validate
from sage.eval.checkpoint import check_prompt_format
from sage.eval.main import register_evaluate_configs
from sage.tracking import RUN_ID_FILE, check_store, open_store

CONF = Path(__file__).resolve().parents[1] / "conf"
register_evaluate_configs()  # sage-eval's schema (base_evaluate) and the groups'


def compose_cfg(config: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config, overrides=list(overrides))


def entry_point(module: str, *overrides: str, env: dict[str, str] | None = None, timeout: int = 300):
    return prefork.run(
        [sys.executable, "-m", module, *overrides],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


def one_line(r: subprocess.CompletedProcess, code: int = 2) -> str:
    """The whole stderr of a refused command: ``code`` and exactly one line, returned."""
    assert r.returncode == code, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


# ------------------------------------------------------------- item 6 and 7: values checked at config time
EVAL_VALUES = [
    ("eval.temperature=-1", "eval.temperature must be a finite number > 0 (got -1.0)"),
    ("eval.temperature=0", "eval.temperature must be a finite number > 0 (got 0.0)"),
    ("eval.temperature=nan", "eval.temperature must be a finite number > 0 (got nan)"),
    ("eval.top_p=0", "eval.top_p must be in (0, 1] (got 0.0)"),
    ("eval.top_p=1.5", "eval.top_p must be in (0, 1] (got 1.5)"),
    (
        "eval.max_new_tokens=0",
        "eval.max_new_tokens must be >= 1, or null for model.max_completion_length (got 0)",
    ),
    (
        "eval.seeds=[0,0]",
        "eval.seeds must be distinct (got [0, 0]): a repeated seed draws the same samples again",
    ),
    ("eval.seeds=[-1]", "eval.seeds must be in [0, 2**32) (got -1)"),
    ("eval.seeds=[4294967296]", "eval.seeds must be in [0, 2**32) (got 4294967296)"),
]
TRAIN_VALUES = [
    (
        "trl.max_steps=-1",
        "trl.max_steps must be >= 0 (got -1): the run's length in optimiser steps (0: evaluate the start "
        "model only); training by epochs (-1) is not supported",
    ),
    ("seed=-1", "seed must be in [0, 2**32) (got -1)"),
    ("seed=4294967296", "seed must be in [0, 2**32) (got 4294967296)"),
    ("trl.data_seed=-5", "trl.data_seed must be in [0, 2**32) (got -5)"),
]


@pytest.mark.parametrize("override, message", EVAL_VALUES + TRAIN_VALUES)
def test_sage_train_refuses_a_bad_value_at_config_time(override, message):
    with pytest.raises(ConfigError) as error:
        validate(compose_cfg("train", override))
    assert str(error.value) == message


@pytest.mark.parametrize("override, message", EVAL_VALUES)
def test_sage_eval_refuses_a_bad_sampling_value_at_config_time(override, message):
    with pytest.raises(ConfigError) as error:
        check_eval(compose_cfg("evaluate", override).eval)
    assert str(error.value) == message


def test_sound_values_pass_and_null_max_new_tokens_is_the_models_length():
    for overrides in [(), ("eval.max_new_tokens=1", "eval.top_p=1", "eval.seeds=[0,4294967295]", "seed=0")]:
        validate(compose_cfg("train", *overrides))
    assert compose_cfg("train").eval.max_new_tokens is None  # the only way to say "model's length"
    with pytest.raises(ConfigError, match="model.sft.args.seed must be in"):
        validate(compose_cfg("train", "model=tiny_sft", "model.sft.args.seed=-1"))


@pytest.mark.parametrize("override", ["trl.max_steps=-1", "seed=4294967296", "eval.max_new_tokens=0"])
def test_sage_train_prints_one_line_and_builds_nothing(override, tmp_path):
    """max_steps=-1 evaluated the base model only and exited 0 under a GRPO tag; a seed of 2**32 was a
    traceback after the run had been created; max_new_tokens=0 silently sampled 64 tokens."""
    r = entry_point("sage.train", override, f"output_dir={tmp_path / 'a'}", "tracking.enabled=false")
    expected = dict(EVAL_VALUES + TRAIN_VALUES)[override]
    assert one_line(r) == f"error: {expected}"
    assert only_hydra_files(tmp_path / "a")


def test_sage_eval_prints_one_line_and_creates_nothing(tmp_path):
    """top_p=0 was a 37-line traceback from the sampler, after the MLflow run existed."""
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _, experiment = open_store(store, "sage")
    out = tmp_path / "results"
    r = entry_point("sage.eval", "eval.top_p=0", f"output_dir={out}", f"tracking.uri={store}")
    assert one_line(r) == "error: eval.top_p must be in (0, 1] (got 0.0)"
    assert not out.exists() and MlflowClient(store).search_runs([experiment], run_view_type=3) == []


# ------------------------------------------------------------------- item 9: a server that never answers
@pytest.fixture
def silent_server():
    """A real socket that accepts every connection and never sends a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.settimeout(0.2)
    held, stop = [], threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def tracking_cfg(uri: str):
    return OmegaConf.create({"tracking": {"enabled": True, "uri": uri, "experiment": "e"}})


def test_a_server_that_never_answers_fails_the_check_within_10_s(silent_server):
    """It took 3 x 20 s read timeouts plus backoff (74 s from the command line)."""
    import mlflow.tracking  # noqa: F401  (imported before the clock starts: the check's time is the network's)

    before = dict(os.environ)
    start = time.monotonic()
    with pytest.raises(ConfigError) as error:
        check_store(tracking_cfg(silent_server))
    assert time.monotonic() - start < 10
    assert str(error.value) == (
        f"tracking.uri={silent_server}: the MLflow store cannot be opened: Read timed out. (read timeout=3)"
    )
    assert dict(os.environ) == before  # the probe's limits are not left to the rest of the process


def test_a_hung_or_refused_server_is_one_line_with_no_retry_warnings(silent_server):
    """A refused port printed two urllib3 retry warnings before its line."""
    for uri, reason in [
        (silent_server, "Read timed out. (read timeout=3)"),
        ("http://127.0.0.1:9", "Failed to establish a new connection: [Errno 111] Connection refused"),
    ]:
        r = entry_point("sage.train", f"tracking.uri={uri}", "output_dir=/nonexistent/never/made")
        assert one_line(r) == f"error: tracking.uri={uri}: the MLflow store cannot be opened: {reason}"


# --------------------------------------------------------------------------------- item 10: SIGTERM
def test_sigterm_is_left_to_a_handler_already_installed():
    """Under submitit, SIGTERM is submitit's (it lets a preempted job live on to its requeue signal)."""

    def submitit_like(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, submitit_like)
    try:
        seen = exit_on_config_error(lambda cfg: signal.getsignal(signal.SIGTERM), OmegaConf.create({}))
        assert seen is submitit_like
    finally:
        signal.signal(signal.SIGTERM, previous)
    seen = exit_on_config_error(lambda cfg: signal.getsignal(signal.SIGTERM), OmegaConf.create({}))
    assert seen is not signal.SIG_DFL and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_the_interruption_hint_names_the_folder_and_offers_resume_only_from_a_checkpoint(
    tmp_path, monkeypatch, capsys
):
    """Issue 47: the Ctrl-C hint said "rerun with resume=true" where no checkpoint existed (a rerun with it
    is then refused) and did not name the folder. Now it says what the folder keeps and what a rerun does."""
    import sage.killed
    from sage.train.main import interruption_hint
    from sage.train.resume import FINAL_FILE

    out = tmp_path / "run"
    cfg = OmegaConf.create({"output_dir": str(out), "trl": {"save_steps": 50, "max_steps": 10}})
    hint = functools.partial(interruption_hint, cfg)
    assert hint() == (
        f"no checkpoint was saved in {out} (trl.save_steps=50): nothing of the training is kept, and a rerun "
        "starts over"
    )
    (out / "rl" / "checkpoint-7").mkdir(parents=True)  # its save was cut short: not one to resume from
    assert "resume=true" not in hint()
    (out / "final").mkdir()
    (out / "final" / FINAL_FILE).write_text(json.dumps({"global_step": 10}))
    assert hint() == f"the finished model is kept in {out}/final; rerun with output_dir={out} to evaluate it"
    (out / "rl" / "checkpoint-3").mkdir()
    (out / "rl" / "checkpoint-3" / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    assert hint() == (
        f"checkpoint-3 and finished evaluation cells are kept in {out}; rerun with output_dir={out} "
        "resume=true to continue"
    )

    def interrupted(cfg):
        sage.killed._KILLED_RUNS.append("a-run")  # what closing the MLflow run on Ctrl-C records
        raise KeyboardInterrupt

    monkeypatch.setattr(sage.killed, "_KILLED_RUNS", [])
    with pytest.raises(SystemExit) as e:
        exit_on_config_error(interrupted, cfg, rerun=hint)
    assert e.value.code == 130
    said = capsys.readouterr().err.strip()
    assert said == f"interrupted (Ctrl-C): the MLflow run is marked KILLED; {hint()}"


def wait_for_line(proc: subprocess.Popen, prefix: str, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    for line in proc.stdout:
        if line.startswith(prefix) or time.monotonic() > deadline:
            return


SHORT_STEPS = ("trl.per_device_train_batch_size=16", "trl.num_generations=4")


@pytest.fixture(scope="module")
def terminated_run(tmp_path_factory):
    """A real sage-train run sent SIGTERM once its third step is logged, after checkpoint-2 was saved."""
    root = tmp_path_factory.mktemp("terminated")
    store, out = f"sqlite:///{root / 'mlflow.db'}", root / "run"
    open_store(store, "sage")  # an existing store: its creation logs nothing on stderr
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sage.train",
            "trl.max_steps=200",
            "trl.save_steps=1",
            *SHORT_STEPS,
            f"output_dir={out}",
            f"tracking.uri={store}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        preexec_fn=as_foreground,
    )
    try:
        wait_for_line(proc, "step 3/", deadline_s=900)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, err, out, store


@pytest.mark.slow
def test_sigterm_marks_the_run_killed_in_one_line(terminated_run):
    """SIGTERM left the MLflow run RUNNING with no message."""
    from mlflow.tracking import MlflowClient

    code, err, out, store = terminated_run
    assert code == 143, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    # issue 47: the hint names the folder and the checkpoint that resume=true continues from
    assert re.fullmatch(
        rf"terminated \(SIGTERM\): the MLflow run is marked KILLED; checkpoint-\d+ and finished evaluation "
        rf"cells are kept in {re.escape(str(out))}; rerun with output_dir={re.escape(str(out))} resume=true "
        "to continue",
        err.strip().splitlines()[-1],
    ), err[-3000:]
    run = MlflowClient(store).get_run((out / RUN_ID_FILE).read_text())
    assert run.info.status == "KILLED"


@pytest.mark.slow
def test_shrinking_max_steps_on_resume_is_one_line_and_changes_nothing(terminated_run):
    """A resume with trl.max_steps below the checkpoint's step recorded train/steps of the smaller value
    for a model trained further."""
    from mlflow.tracking import MlflowClient

    _, _, out, store = terminated_run
    config = (out / "config.yaml").read_text()
    run_id = (out / RUN_ID_FILE).read_text()
    overrides = ("resume=true", "trl.max_steps=1", *SHORT_STEPS, f"output_dir={out}", f"tracking.uri={store}")
    r = entry_point("sage.train", *overrides)
    line = one_line(r)
    reached = re.fullmatch(
        rf"error: trl.max_steps=1 is below step (\d+), which the model in {re.escape(str(out))} has already "
        r"trained to: a run can be extended, not shortened; give trl.max_steps >= \1, or another output_dir",
        line,
    )
    assert reached is not None and int(reached.group(1)) >= 2, line
    assert (out / "config.yaml").read_text() == config
    assert MlflowClient(store).get_run(run_id).info.status == "KILLED"  # not reopened


# ---------------------------------------------------------------------- item 10: sage-eval's interrupt
@pytest.mark.slow
def test_sage_evals_ctrl_c_does_not_advise_resume(tmp_path, testbed_model):
    """It advised resume=true, a key sage-eval rejects."""
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    open_store(store, "sage")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sage.eval",
            f"checkpoint={testbed_model}",
            f"output_dir={tmp_path / 'results'}",
            "eval.n_samples=256",
            f"tracking.uri={store}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        preexec_fn=as_foreground,
    )
    try:
        for line in proc.stdout:  # the run exists once this is logged; sampling 200 x 256 comes next
            if "MLflow run" in line:
                break
        time.sleep(2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last == (
        "interrupted (Ctrl-C): the MLflow run is marked KILLED; finished checkpoints and evaluation cells "
        "are kept (the same command samples only the missing cells)"
    )
    (run,) = MlflowClient(store).search_runs(
        [MlflowClient(store).get_experiment_by_name("sage").experiment_id]
    )
    assert run.info.status == "KILLED"


# ---------------------------------------------------------------------- item 10: prompt format mismatch
def chat_copy(testbed: Path, folder: Path) -> Path:
    """The testbed model with a chat template in its tokenizer, as a chat run's final/ has."""
    from sage.testbed.tokenizer import CHAT_TEMPLATE

    shutil.copytree(testbed, folder)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return folder


def test_the_model_options_prompt_format_must_be_the_checkpoints(tmp_path, testbed_model):
    check_prompt_format(str(testbed_model), chat=False)
    with pytest.raises(ConfigError) as error:
        check_prompt_format(str(testbed_model), chat=True)
    assert str(error.value) == (
        f"checkpoint={testbed_model} has a bare-text tokenizer (no chat template) but model.chat=true: "
        "choose the model option it was trained with (e.g. model=tiny), or one with chat: false"
    )
    chat = chat_copy(testbed_model, tmp_path / "chat")
    check_prompt_format(str(chat), chat=True)
    with pytest.raises(ConfigError) as error:
        check_prompt_format(str(chat), chat=False)
    assert str(error.value) == (
        f"checkpoint={chat} has a chat tokenizer (a chat template) but model.chat=false: choose the model "
        "option it was trained with (e.g. model=tiny_chat), or one with chat: true"
    )
    # a LoRA adapter saved without a tokenizer is read through its base's
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(chat)}))
    with pytest.raises(ConfigError, match="has a chat tokenizer"):
        check_prompt_format(str(adapter), chat=False)


@pytest.mark.parametrize("case", ["tiny_chat_on_bare", "bare_on_chat"])
def test_sage_eval_refuses_a_mismatched_prompt_format_before_anything_exists(case, tmp_path, testbed_model):
    """model=tiny_chat on a bare checkpoint was a traceback and a FAILED run; a chat checkpoint under a
    bare model option was scored on prompts in a format it was never trained on."""
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _, experiment = open_store(store, "sage")
    if case == "tiny_chat_on_bare":
        checkpoint = tmp_path / "bare"
        shutil.copytree(testbed_model, checkpoint)
        overrides, expected = ["model=tiny_chat"], "has a bare-text tokenizer (no chat template)"
    else:
        checkpoint = chat_copy(testbed_model, tmp_path / "chat")
        overrides, expected = [], "has a chat tokenizer (a chat template)"
    r = entry_point("sage.eval", f"checkpoint={checkpoint}", f"tracking.uri={store}", *overrides)
    line = one_line(r)
    assert line.startswith(f"error: checkpoint={checkpoint} {expected}"), line
    assert not (checkpoint / "eval").exists()
    assert MlflowClient(store).search_runs([experiment], run_view_type=3) == []


# ------------------------------------------------------------------------------ item 10: sage-report
def report(*argv: str, capsys) -> tuple[int, str]:
    from analysis import report as report_cli

    code = report_cli.main(list(argv))
    return code, capsys.readouterr().err


def test_a_corrupt_report_store_is_one_line(tmp_path, capsys):
    """It was a 72-line traceback."""
    corrupt = tmp_path / "mlflow.db"
    corrupt.write_bytes(b"this is not a database" * 100)
    code, err = report(
        "--tracking-uri", f"sqlite:///{corrupt}", "--out", str(tmp_path / "r.md"), capsys=capsys
    )
    assert code == 2
    assert err == (
        f"sage-report: the MLflow store sqlite:///{corrupt} cannot be read: (sqlite3.DatabaseError) file is "
        "not a database\n"
    )
    assert not (tmp_path / "r.md").exists()


def test_seeds_that_match_no_run_are_an_error(tmp_path, capsys):
    """--seeds 99 wrote an empty report and exited 0."""
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(store)
    exp = client.create_experiment("e")
    for seed in (1, 2):
        run = client.create_run(exp, tags={"sage.kind": "train", "seed": str(seed), "method": "grpo"})
        client.set_terminated(run.info.run_id)
    out = tmp_path / "r.md"
    code, err = report(
        "--tracking-uri", store, "--experiment", "e", "--seeds", "99", "--out", str(out), capsys=capsys
    )
    assert code == 2 and not out.exists()
    assert err.splitlines()[-1] == (  # after MLflow's lines on creating the store
        "sage-report: --seeds 99: no finished sage-train run of experiment 'e' has any of these seeds "
        "(seeds present: [1, 2])"
    )


# ---------------------------------------------------------------------------------- item 10: full disk
def test_a_full_disk_is_recognised_by_its_errno_or_its_words_and_named(tmp_path):
    cfg = OmegaConf.create({"output_dir": str(tmp_path / "run"), "tracking": {"uri": None}})
    metrics = tmp_path / "run" / "metrics.json"
    named = OSError(errno.ENOSPC, "No space left on device", str(metrics))
    assert full_disk(named, cfg) == (
        f"the disk is full: no space left to write {metrics}; free space there and rerun"
    )
    # safetensors (Rust) says it in words only; chained below the error the run actually raised
    try:
        try:
            raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
        except RuntimeError as e:
            raise ValueError("saving the checkpoint failed") from e
    except ValueError as e:
        line = full_disk(e, cfg)
    assert line == (
        f"the disk is full: a write failed with no space left on device (the run writes to {tmp_path}); "
        "free space there and rerun"
    )
    assert full_disk(RuntimeError("CUDA out of memory"), cfg) is None  # any other failure keeps its traceback
    # torch.save's writer gives no cause: it is the disk only if one the run writes to is full
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert full_disk(torch_error, cfg) is None


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB filesystem (tmpfs), which a checkpoint of the testbed model overflows."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_torchs_write_failure_on_a_full_disk_names_it(small_disk):
    import torch

    cfg = OmegaConf.create({"output_dir": str(small_disk / "run"), "tracking": {"uri": None}})
    try:
        torch.save({"w": torch.zeros(1 << 20)}, small_disk / "optimizer.pt")
    except RuntimeError as e:
        line = full_disk(e, cfg)
    else:
        raise AssertionError("4 MiB fitted on a 3 MiB disk")
    assert re.fullmatch(
        rf"the disk is full: {small_disk} has \d+ bytes left and a write failed; free space there and rerun",
        line,
    ), line


@pytest.mark.slow
def test_a_run_on_a_full_disk_is_one_line_naming_it(small_disk, tmp_path):
    """It was a torch error ('unexpected pos 576 vs 534') that never said the disk was full."""
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    open_store(store, "sage")
    out = small_disk / "run"
    r = entry_point(
        "sage.train",
        "trl.max_steps=2",
        "trl.save_steps=1",
        "trl.per_device_train_batch_size=16",
        "trl.num_generations=4",
        "eval.at_end=false",
        f"output_dir={out}",
        f"tracking.uri={store}",
        timeout=900,
    )
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    # which form depends on whether the failed save's partial file was removed before the check
    where = (
        rf"{re.escape(str(small_disk))} has \d+ bytes left and a write failed"
        rf"|no space left to write {re.escape(str(out))}/\S+"
        rf"|a write failed with no space left on device \(the run writes to {re.escape(str(out))}\)"
    )
    assert re.fullmatch(rf"error: the disk is full: ({where}); free space there and rerun", last), last
    assert MlflowClient(store).get_run((out / RUN_ID_FILE).read_text()).info.status == "FAILED"


@pytest.mark.slow
def test_a_store_that_fills_mid_run_is_one_line_and_the_run_failed(small_disk, tmp_path):
    """Issue 47: an SQLite store whose disk filled mid-run printed 85 lines of MLflow's traceback first and
    left the run RUNNING. The store is made, then its filesystem shrunk to what the empty store takes plus
    a little: the run's metrics fill it."""
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{small_disk / 'mlflow.db'}"
    open_store(store, "sage")
    used = shutil.disk_usage(small_disk).used
    shrunk = subprocess.run(
        ["mount", "-o", f"remount,size={used + (96 << 10)}", str(small_disk)], capture_output=True
    )
    if shrunk.returncode != 0:
        pytest.skip(f"cannot shrink the small filesystem here: {shrunk.stderr.decode().strip()}")
    out = tmp_path / "run"  # the run's own folder on a disk with room
    r = entry_point(
        "sage.train",
        "trl.max_steps=2",
        "trl.per_device_train_batch_size=16",
        "trl.num_generations=4",
        "eval.limit=8",
        "eval.n_samples=4",
        "eval.ks=[1,4]",
        f"output_dir={out}",
        f"tracking.uri={store}",
        timeout=900,
    )
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "database or disk is full" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"error: the disk is full: {re.escape(str(small_disk))} has \d+ bytes left and a write failed; free "
        "space there and rerun",
        last,
    ), last
    assert MlflowClient(store).get_run((out / RUN_ID_FILE).read_text()).info.status == "FAILED"

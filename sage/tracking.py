"""MLflow as the single record of runs: params, tags, per-step metrics, evaluation curves, artifacts.

- Store: ``tracking.uri``, else ``$MLFLOW_TRACKING_URI``, else an embedded SQLite store
  ``<cwd>/outputs/mlflow.db`` (artifacts beside it in ``outputs/mlartifacts``).
- A run's MLflow id is kept in ``<output_dir>/mlflow_run_id``: a resumed run (``resume=true``, a requeued
  SLURM job) continues the SAME MLflow run, and steps it had already logged are not logged twice.
  ``mlflow_run_id.json`` beside it records the store and the folder itself: a copy of the folder (another
  path) starts a run of its own instead of logging into the original's.
- Nothing secret is logged: credentials in URIs are redacted and keys that name secrets are dropped.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from sage.durable import exclusive_lock
from sage.errors import NO_SPACE_TEXT, ConfigError
from sage.killed import record_killed
from sage.run_names import hydra_context, method_of, run_name

log = logging.getLogger(__name__)


class _FullDiskNoise(logging.Filter):
    """MLflow's SQL store logs a failed commit with its whole traceback before it raises. On a full disk
    the raised error ends the run with one line naming where (sage.cli.full_disk), so the log is only
    noise above it: dropped. Every other store error is logged as MLflow logs it."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not any(t in str(error) for t in NO_SPACE_TEXT) if error is not None else True


logging.getLogger("mlflow.store.db.utils").addFilter(_FullDiskNoise())

RUN_ID_FILE = "mlflow_run_id"
SECRET_KEY = re.compile(r"(token|password|passwd|secret|api[_-]?key|credential)", re.IGNORECASE)
URI_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")
PARENT_TAG = "mlflow.parentRunId"  # MLflow's UI nests a run under the run this tag names
NOTE_TAG = "mlflow.note.content"  # the run's Description in MLflow's UI
RUN_NOTE = (
    "Metrics pass_at_<k>/<label>/<dataset> are logged at the optimiser step of the evaluated model "
    "(0 for the base model). In the series pass_at_k_curve/<label>/<dataset> the step is k, not a "
    "training step: the chart is pass@k against k. Artifacts under eval/ hold the pass@k figure and table "
    "and the completions of the first evaluation seed as a table. The tag sage.eval.<label>.<dataset> names "
    "the settings of the latest evaluation (step, ks, n_samples, eval seeds, problems); its list 'stale' "
    "names the metrics of that label and dataset left by an earlier evaluation under other settings, "
    "which are not this evaluation's numbers."
)
# The config groups whose choice is a tag (the filters users group runs by).
GROUP_TAGS = (
    "model",
    "data",
    "algorithm",
    "divergence",
    "guide",
    "schedule",
    "rollout",
    "eval",
    "trl",
    "experiment",
    "regime",
)


def redact(value: str) -> str:
    """``postgresql://user:pw@host/db`` -> ``postgresql://***@host/db``."""
    return URI_CREDENTIALS.sub(r"\g<scheme>***@", value)


def default_uri() -> str:
    root = Path.cwd() / "outputs"
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


def resolve_uri(configured: str | None) -> str:
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or default_uri()


def flatten(node: Any, prefix: str = "") -> dict[str, str]:
    """Resolved config -> {dotted.key: str(value)} without secrets; lists stay one value."""
    out: dict[str, str] = {}
    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if SECRET_KEY.search(str(k)):
                continue
            out.update(flatten(v, key))
    else:
        out[prefix] = redact(str(node))[:6000]  # MLflow's param value limit
    return out


def git_commit() -> str:
    try:
        r = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unavailable"
    return r.stdout.strip() if r.returncode == 0 else "not-a-git-checkout"


def eval_tag(label: str, dataset: str) -> str:
    """The tag naming what a run's latest evaluation of ``label`` on ``dataset`` logged (Tracker.log_eval)."""
    return f"sage.eval.{label}.{dataset}"


# What makes two evaluations of one model the same samples (the fields of the eval_tag record)
SAME_SAMPLES = ("step", "n_samples", "seeds", "problems")


class Tracker:
    """One MLflow run bound to one output folder. Use ``start_run`` (a context manager)."""

    def __init__(self, client, run_id: str, resumed: bool):
        self.client = client
        self.run_id = run_id
        self.resumed = resumed
        self._last_step = self._last_logged_step() if resumed else -1
        self._eval_steps: dict[str, int] = {}  # label -> the step its evaluation was logged at
        self._eval_records: dict[tuple[str, str], dict] = {}  # (label, dataset) -> its eval_tag record
        # dataset -> label -> pass@k curve per evaluation seed: a dataset's figure shows base and trained
        self._curves: dict[str, dict[str, list[dict[int, float]]]] = {}

    def _last_logged_step(self) -> int:
        history = self.client.get_metric_history(self.run_id, "train/loss")
        return max((m.step for m in history), default=-1)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        if step <= self._last_step:  # already recorded before the crash: never duplicate
            return
        ts = _now_ms()
        batch = [Metric(metric_key(k), float(v), ts, step) for k, v in metrics.items() if _is_number(v)]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def log_training_step(self, logs: dict[str, Any], step: int) -> None:
        self.log_metrics({f"train/{k}": v for k, v in logs.items()}, step)

    def log_eval(
        self,
        label: str,
        dataset: str,
        result: dict,
        ks: list[int],
        n_problems: int | None,
        step: int = 0,
        rows: list[dict] | None = None,
    ) -> None:
        """pass@k at the reported ks as metrics at ``step``, the optimiser step of the evaluated model (0 for
        a base model), so the evaluations of a run extended to more steps form a history; with one
        evaluation seed no ``_std`` (it would chart as nothing). The whole curve k = 1..n as a series with
        step = k. Artifacts: the correctness matrices of every seed (npz: arr_0, arr_1, ... problems x
        samples, for machines) and, given ``rows``, the ids of their problems in order (``_problems.json``);
        for a person, ``eval/passk_<dataset>.png`` (pass@k against log k, every label evaluated so far,
        mean over seeds with the seeds' range as a band) and its numbers as ``eval/passk_<dataset>.csv``,
        and the completions of the first seed for the first ``n_problems`` problems (None: all) as an MLflow
        table with prompt, gold, completion, extracted answer and correct
        (prompt and gold need ``rows``, the dataset's rows). A point the run already holds (same key, step
        and value: a resumed run evaluating the same model again) is not logged twice."""
        from sage.metrics import metric_name, pass_at_k_curve

        self._eval_steps[label] = step
        # MLflow keeps every point ever logged, and a run re-evaluated under other settings at the same step
        # (a resume with other eval.ks or eval.n_samples) still holds the earlier evaluation's pass@k at
        # other ks and its curve beyond the new n: this tag names what the latest evaluation logged, and
        # the report reads only that (analysis.load.eval_frame, curve_frame, analysis_frame). Its list
        # "stale" names the metrics of (label, dataset) the run holds from an earlier evaluation and this
        # one has not logged (yet: log_analyses takes out those it logs), so that no run shows two
        # evaluations' numbers side by side unmarked.
        summary = result["summary"]
        if len(result["correct"]) == 1:
            summary = {k: v for k, v in summary.items() if not k.endswith("_std")}
        record = {
            "step": step,
            "ks": sorted(int(k) for k in ks),
            "n_samples": int(result["correct"][0].shape[1]),
            "seeds": len(result["correct"]),
            "problems": int(result["correct"][0].shape[0]),
        }
        curve_name = metric_key(metric_name(label, dataset, "pass@k_curve"))
        logged = {metric_key(metric_name(label, dataset, k)) for k, v in summary.items() if _is_number(v)}
        run = self.client.get_run(self.run_id).data
        earlier = json.loads(run.tags.get(eval_tag(label, dataset)) or "null")
        suffix = f"/{label}/{dataset}"
        held = {k for k in run.metrics if k.endswith(suffix)} - logged - {curve_name}
        if earlier is not None and all(earlier.get(f) == record[f] for f in SAME_SAMPLES):
            # the same samples again (a resume evaluating the same model): what the earlier evaluation
            # logged is this one's, but for its pass@k at ks this one does not report
            held = {k for k in held if k in earlier.get("stale", ()) or re.match(r"pass_at_\d+(_std)?/", k)}
        record["stale"] = sorted(held)
        self._eval_records[(label, dataset)] = record
        self._set_eval_tag(label, dataset, record)
        self._log_new(_metrics({metric_name(label, dataset, k): v for k, v in summary.items()}, step=step))
        curves = [pass_at_k_curve(c) for c in result["correct"]]
        mean_curve = {k: float(np.mean([c[k] for c in curves])) for k in curves[0]}
        self._log_new([_metric(curve_name, v, k) for k, v in mean_curve.items()])
        self._curves.setdefault(dataset, {})[label] = curves
        # deferred: what reads the record (analysis/) imports this module, and never sage.eval
        from sage.eval.artifacts import completions_table, passk_figure, passk_table

        with tempfile.TemporaryDirectory() as tmp:
            matrices = Path(tmp) / f"{label}_{dataset}_correct.npz"
            np.savez_compressed(matrices, *result["correct"])
            self.client.log_artifact(self.run_id, str(matrices), artifact_path=f"eval/{label}")
            if rows is not None and len(rows) == record["problems"] and all("id" in r for r in rows):
                # the matrices' rows are these problems, in this order: a report names them by id
                ids = Path(tmp) / f"{label}_{dataset}_problems.json"
                ids.write_text(json.dumps([str(r["id"]) for r in rows]))
                self.client.log_artifact(self.run_id, str(ids), artifact_path=f"eval/{label}")
            table = passk_table(self._curves[dataset])
            csv = Path(tmp) / f"passk_{dataset}.csv"
            table.to_csv(csv, index=False)
            figure = passk_figure(table, dataset, Path(tmp) / f"passk_{dataset}.png")
            for f in (csv, figure):
                self.client.log_artifact(self.run_id, str(f), artifact_path="eval")
        name = f"eval/{label}/{label}_{dataset}_completions_step{step}.json"
        if not self._holds(name):  # log_table appends to an existing file: a resumed run's would double
            frame = completions_table(result["completions"][0], result["correct"][0], rows, n_problems)
            self.client.log_table(self.run_id, data=frame, artifact_file=name)

    def _holds(self, artifact: str) -> bool:
        folder = artifact.rsplit("/", 1)[0]
        held = self.client.list_artifacts(self.run_id, folder) if self.resumed else []
        return any(f.path == artifact for f in held)

    def log_analyses(
        self, label: str, dataset: str, values: dict[str, float], perplexities: list[float] | None
    ) -> None:
        """What the samples say (``sage.eval.analyses``): each value as ``<name>/<label>/<dataset>``
        (a NaN, nothing to measure, is not logged) at the step of the label's ``log_eval`` (0 if none) and
        the per-sample perplexities under the base model as the artifact
        ``eval/<label>/<label>_<dataset>_perplexity.json`` with their median as a metric."""
        from sage.metrics import metric_name

        values = dict(values)
        if perplexities:
            values["perplexity_median"] = float(np.median(perplexities))
        step = self._eval_steps.get(label, 0)
        self._log_new(_metrics({metric_name(label, dataset, k): v for k, v in values.items()}, step))
        record = self._eval_records.get((label, dataset))
        if record and record["stale"]:  # what this evaluation's analyses logged is no longer stale
            logged = {metric_key(metric_name(label, dataset, k)) for k, v in values.items() if _is_number(v)}
            record["stale"] = [k for k in record["stale"] if k not in logged]
            self._set_eval_tag(label, dataset, record)
        if perplexities is not None:
            with tempfile.TemporaryDirectory() as tmp:
                f = Path(tmp) / f"{label}_{dataset}_perplexity.json"
                f.write_text(json.dumps(perplexities))
                self.client.log_artifact(self.run_id, str(f), artifact_path=f"eval/{label}")

    def stale(self, label: str, dataset: str) -> list[str]:
        """The metrics of (label, dataset) the run holds from an earlier evaluation of other samples that
        this one has not logged yet (its eval tag's "stale" list; [] before this run's ``log_eval``)."""
        return list(self._eval_records.get((label, dataset), {}).get("stale", ()))

    def _set_eval_tag(self, label: str, dataset: str, record: dict) -> None:
        """The eval_tag record, its stale list cut to MLflow's tag length (8,000) with "..." last."""
        text, stale = json.dumps(record), list(record["stale"])
        while len(text) > 7000 and stale:
            stale = stale[: len(stale) // 2]
            text = json.dumps({**record, "stale": [*stale, "..."]})
        self.set_tag(eval_tag(label, dataset), text)

    def _log_new(self, metrics: list) -> None:
        """Log the points the run does not hold yet as the latest of their key and step (same value); only
        a resumed run can. A value held under an earlier point only (an evaluation at n=2, another at n=4,
        then n=2 again) is logged again: MLflow shows a key's latest point."""
        if self.resumed:
            held: dict[str, dict[int, float]] = {}
            for key in {m.key for m in metrics}:
                history = self.client.get_metric_history(self.run_id, key)
                held[key] = {m.step: m.value for m in sorted(history, key=lambda m: (m.step, m.timestamp))}
            metrics = [m for m in metrics if held[m.key].get(m.step) != m.value]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path=artifact_path)

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, redact(value))


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and np.isfinite(v)


def metric_key(key: str) -> str:
    """MLflow allows no '@' in names: ``pass@64`` is logged as ``pass_at_64``."""
    return key.replace("@", "_at_")


def _metric(key: str, value: float, step: int):
    from mlflow.entities import Metric

    return Metric(metric_key(key), float(value), _now_ms(), step)


def _metrics(values: dict[str, float], step: int) -> list:
    return [_metric(k, v, step) for k, v in values.items() if _is_number(v)]


def experiment_id(client, name: str, uri: str) -> str:
    """Get or create the experiment; parallel jobs of a sweep may race to create it, and the loser reads
    the winner's."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    artifacts = None
    if uri.startswith("sqlite:///"):
        artifacts = Path(uri.removeprefix("sqlite:///")).parent.joinpath("mlartifacts").as_uri()
    try:
        return client.create_experiment(name, artifact_location=artifacts)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


def open_store(uri: str, experiment: str):
    """(client, experiment id). The parallel jobs of a sweep may all open a new SQLite store at once, and
    MLflow's schema creation is not safe under that race (duplicate columns, a leftover alembic table that
    breaks the store for good), so opening a SQLite store is serialised by a lock file beside it."""
    from mlflow.tracking import MlflowClient

    if not uri.startswith("sqlite:///"):
        client = MlflowClient(tracking_uri=uri)
        return client, experiment_id(client, experiment, uri)
    db = Path(uri.removeprefix("sqlite:///"))
    with exclusive_lock(db.with_name(db.name + ".lock")):
        client = MlflowClient(tracking_uri=uri)
        return client, experiment_id(client, experiment, uri)


# The probe's limits, through MLflow's own settings: two short attempts, so that a server that accepts
# connections but never answers fails the check in seconds, not after MLflow's minutes of retries.
PROBE_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "3"}
# The run's own requests, once the server has answered: a few retries, each patient enough for a busy server.
RUN_HTTP = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}


@contextmanager
def probe_limits() -> Iterator[None]:
    """PROBE_HTTP for the duration (the environment's own MLFLOW_HTTP_REQUEST_* settings win), with
    urllib3's retry warnings silenced: the check's failure is one line, and a retry is no news."""
    added = {k: v for k, v in PROBE_HTTP.items() if k not in os.environ}
    os.environ.update(added)
    retries = logging.getLogger("urllib3.connectionpool")
    level = retries.level
    retries.setLevel(logging.ERROR)
    try:
        yield
    finally:
        retries.setLevel(level)
        for k in added:
            del os.environ[k]


def store_failure(error: Exception) -> str:
    """The reason a store could not be opened, in a few words: urllib3's cause (connection refused, read
    timed out) rather than MLflow's wrapper of it, else the error's first line."""
    text = str(error).strip()
    cause = re.search(r"Caused by \w+\([\"'].*?\): (.*?)[\"']\)+$", text, flags=re.DOTALL)
    if cause:
        return cause.group(1)
    return (text.splitlines() or [type(error).__name__])[0][:300]


def check_store(cfg: DictConfig) -> None:
    """Open the run's MLflow store before any expensive work, so that an unreachable or hung server or a
    corrupt SQLite file fails in seconds with one line (``probe_limits``)."""
    if not cfg.tracking.enabled:
        return
    uri = resolve_uri(cfg.tracking.uri)
    try:
        with probe_limits():
            open_store(uri, cfg.tracking.experiment)
    except Exception as e:  # any failure to reach or read the store: its reason, once
        raise ConfigError(
            f"tracking.uri={redact(uri)}: the MLflow store cannot be opened: {store_failure(e)}"
        ) from e
    for k, v in RUN_HTTP.items():
        os.environ.setdefault(k, v)


def _run_in_store(client, id_file: Path):
    """The run ``id_file`` names, if this store holds it and it is this folder's. A folder shared by runs
    logged to different stores (the base model's evaluation cache) may name a run of another store: that
    one is not ours to continue, and a new run starts. So does a copy of a folder (``cp -r a b``): its
    record names the folder it was made in, and the original's run stays the original's alone."""
    from mlflow.exceptions import MlflowException

    if not id_file.exists():
        return None
    run_id = id_file.read_text().strip()
    made_in = _read_record(id_file).get("folder")
    if made_in is not None and made_in != str(id_file.parent.resolve()):
        log.info(
            "MLflow run %s named in %s is %s's (this is a copy): a new run starts", run_id, id_file, made_in
        )
        return None
    try:
        return client.get_run(run_id)
    except MlflowException:
        log.info("MLflow run %s named in %s is not in this store: a new run starts", run_id, id_file)
        return None


def _record_file(id_file: Path) -> Path:
    return id_file.with_name(id_file.name + ".json")


def _read_record(id_file: Path) -> dict:
    """What ``id_file``'s folder records about its run: run_id, tracking_uri (redacted) and the folder
    itself. Empty for a folder made before it was recorded."""
    try:
        return json.loads(_record_file(id_file).read_text())
    except (OSError, ValueError):
        return {}


def _write_record(id_file: Path, run_id: str, uri: str) -> None:
    record = {"run_id": run_id, "tracking_uri": redact(uri), "folder": str(id_file.parent.resolve())}
    _record_file(id_file).write_text(json.dumps(record))


def check_run_kept(cfg: DictConfig, out: Path) -> None:
    """The MLflow run a folder continues must not have been deleted (in the UI, or ``mlflow gc``'s first
    step): MLflow refuses every write to a deleted run, so each resume would fail after the model was
    built. A ConfigError naming the run and both ways out, before any work."""
    if not cfg.tracking.enabled:
        return
    uri = resolve_uri(cfg.tracking.uri)
    client, _ = open_store(uri, cfg.tracking.experiment)
    run = _run_in_store(client, out / RUN_ID_FILE)
    if run is not None and run.info.lifecycle_stage == "deleted":
        raise ConfigError(
            f"output_dir={out} continues MLflow run {run.info.run_id}, which was deleted in {redact(uri)}: "
            "restore it (MLflow UI: the experiment's deleted runs -> Restore, or `mlflow runs restore "
            f"--run-id {run.info.run_id}`), or use a new output_dir"
        )


def point_eval_run_at(cfg: DictConfig, record: dict, checkpoint: str) -> None:
    """A sage-eval run (``record``: its folder's record) now names ``checkpoint`` as its checkpoint, the
    folder its weights were moved to, when its store is this config's. A run of another store keeps
    naming the old folder, and a logged line says so (a tag is not worth failing a run for)."""
    uri = resolve_uri(cfg.tracking.uri)
    where = f"MLflow run {record.get('run_id')} ({record.get('tracking_uri')})"
    if record.get("tracking_uri") != redact(uri):
        log.warning("%s still names the old folder as its checkpoint: it is now %s", where, checkpoint)
        return
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(tracking_uri=uri).set_tag(record["run_id"], "checkpoint", redact(checkpoint))
    except Exception as e:  # noqa: BLE001 (any store failure: say so, keep the run going)
        log.warning("%s: its checkpoint tag could not be set to %s: %s", where, checkpoint, e)


@contextmanager
def start_run(
    cfg: DictConfig,
    out: Path,
    kind: str,
    resume: bool = True,
    key: str | None = None,
    what: tuple[str, dict[str, str]] | None = None,
) -> Iterator[Tracker | None]:
    """Open (or, with ``resume``, re-open) the MLflow run of ``out``; ``kind`` is train or eval. Without
    ``resume`` a run an earlier attempt left in ``out`` is closed as FAILED and a new one starts, so two
    attempts never merge into one run. ``key`` (sage-eval: a hash of the settings its numbers depend on)
    gives ``out`` one run per key, recorded in ``mlflow_run_id.<key>`` and tagged ``sage.settings_key``.
    ``what`` (sage-eval: what it evaluated) is a new run's name, unless ``tracking.run_name`` gives one, and
    tags of its own. Yields None when ``tracking.enabled=false``. The run ends FINISHED, KILLED on Ctrl-C,
    FAILED on any other exception."""
    if not cfg.tracking.enabled:
        yield None
        return
    uri = resolve_uri(cfg.tracking.uri)
    client, exp_id = open_store(uri, cfg.tracking.experiment)
    id_file = out / (RUN_ID_FILE if key is None else f"{RUN_ID_FILE}.{key}")
    earlier = _run_in_store(client, id_file)
    resumed = earlier is not None and resume
    if earlier is not None and not resume:
        # killed before it could close its run (a deleted run takes no write, and is no one's to close)
        if earlier.info.status == "RUNNING" and earlier.info.lifecycle_stage != "deleted":
            client.set_terminated(earlier.info.run_id, status="FAILED")
        log.info(
            "MLflow run %s of an earlier attempt in %s is not continued: a new run starts",
            earlier.info.run_id,
            out,
        )
    params = flatten(OmegaConf.to_container(cfg, resolve=True))
    if resumed:
        run_id = id_file.read_text().strip()
        _write_record(id_file, run_id, uri)  # a folder made before records were kept gets one
        client.update_run(run_id, status="RUNNING")
        # MLflow params are write-once: what a resume changed (e.g. a longer max_steps) becomes a tag; one
        # that an earlier resume changed and this one sets back loses its tag, which would be read as the
        # run's setting.
        earlier_run = client.get_run(run_id).data
        for k, v in params.items():
            if earlier_run.params.get(k) != v:
                client.set_tag(run_id, f"resumed.{k}", v)
            elif f"resumed.{k}" in earlier_run.tags:
                client.delete_tag(run_id, f"resumed.{k}")
        if cfg.tracking.parent_run_id:  # a grid rerun: the run joins the grid's parent
            client.set_tag(run_id, PARENT_TAG, str(cfg.tracking.parent_run_id))
    else:
        choices, sweep = hydra_context()
        tags = {
            "sage.kind": kind,
            "seed": str(cfg.get("seed", "none")),  # sage-eval has sampling seeds only (eval.seeds)
            "git_commit": git_commit(),
            "output_dir": str(out),
            **{g: choices[g] for g in GROUP_TAGS if g in choices},
            **sweep,
            **{k: str(v) for k, v in cfg.tracking.tags.items()},
        }
        method = method_of(cfg, choices)
        if method:
            tags["method"] = method
        if key is not None:
            tags["sage.settings_key"] = key
        if what is not None:
            tags.update(what[1])
        tags = {k: redact(v) for k, v in tags.items()}
        if cfg.tracking.parent_run_id:
            tags[PARENT_TAG] = str(cfg.tracking.parent_run_id)
        tags = {**tags, NOTE_TAG: RUN_NOTE}
        name = what[0] if what is not None and not cfg.tracking.run_name else run_name(cfg)
        run = client.create_run(exp_id, run_name=name, tags=tags)
        run_id = run.info.run_id
        id_file.write_text(run_id)
        _write_record(id_file, run_id, uri)
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):
            client.log_batch(run_id, params=items[i : i + 100])
    log.info("MLflow run %s (%s) in %s", run_id, "resumed" if resumed else "new", redact(uri))
    tracker = Tracker(client, run_id, resumed)
    try:
        yield tracker
    except BaseException as e:
        killed = isinstance(e, KeyboardInterrupt)
        client.set_terminated(run_id, status="KILLED" if killed else "FAILED")
        if killed:
            record_killed(run_id)
        raise
    client.set_terminated(run_id, status="FINISHED")


def step_callback(tracker: Tracker):
    """A transformers TrainerCallback that sends every log (TRL's and SageGRPOTrainer's metrics, grad norm,
    learning rate) to the run at the optimiser step it belongs to."""
    from transformers import TrainerCallback

    class _MlflowSteps(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                tracker.log_training_step(logs, state.global_step)

    return _MlflowSteps()

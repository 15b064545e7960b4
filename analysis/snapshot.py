"""A study's runs in one committed file, read back as the MLflow store they came from.

A study's store (hundreds of MB of SQLite rows and artifacts) does not belong in the repository, but a
report must rebuild without rerunning the study. ``export`` writes what ``sage-report`` reads of an
experiment's runs, and nothing else, to one gzipped JSON file:

- each run's info, tags, params and the latest value of each metric (every table reads these);
- the histories of the metrics the report draws as curves or averages over steps (``HISTORY``: pass@k
  curves, periodic pass@1, training reward and gradient norm, the anchor's entropy buckets) and the guide's
  activity (``train/guide/*``), not every training metric's;
- the evaluation artifacts the report reads (``ARTIFACT``): the correctness matrices, packed to one bit
  per sample, the per-sample perplexities and the problem ids, each distinct file once (every run of a
  study evaluates the same base model).

``SnapshotClient`` answers the read-only part of ``MlflowClient`` that ``analysis`` calls from that file,
with MLflow's own entities and its own in-memory filter, sort and paging (``SearchUtils``, as MLflow's file
store does), so ``sage-report --snapshot FILE`` runs the same code on the same values as on the store and
writes the same tables. What the file does not hold is an error naming it, never an empty answer.

The file is deterministic (runs by id, keys in the store's order, gzip without a timestamp): exporting the
same store twice gives the same bytes, so a committed snapshot changes only when its runs do.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import re
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from analysis import load
from analysis.load import ReportError

FORMAT = 1
# metrics whose every logged value the report reads (load.curve_frame, periodic_frame, bucket_frame for the
# report's bucket statistics, history_frame's callers), and the guide's activity during training
# (scripts/training_means.py); of the others only the latest value is kept
HISTORY = (load.CURVE_KEY, load.PERIODIC_KEY, re.compile(r"^train/guide/"))
HISTORY_NAMES = ("train/grad_norm", "train/reward")
# what ``export`` writes of each run, by part: a file without one of these is damaged
RUN_PARTS = ("info", "tags", "params", "metrics", "history", "artifacts")
INFO_FIELDS = ("run_id", "run_name", "experiment_id", "user_id", "status", "start_time", "end_time",
               "lifecycle_stage")  # fmt: skip
ARTIFACT = re.compile(r"^eval/[^/]+/[^/]+_(?P<kind>correct\.npz|perplexity\.json|problems\.json)$")


def kept_history(key: str) -> bool:
    bucket = load.BUCKET_KEY.match(key)
    if bucket:
        return bucket["stat"] in {stat for stat, _ in load.BUCKET_TABLES}
    return key in HISTORY_NAMES or any(k.match(key) for k in HISTORY)


def _pack(matrices: Sequence[np.ndarray]) -> list[dict]:
    return [
        {"shape": list(m.shape), "bits": base64.b64encode(np.packbits(m, axis=None)).decode()}
        for m in matrices
    ]


def _unpack(packed: Sequence[dict]) -> list[np.ndarray]:
    out = []
    for p in packed:
        n = int(np.prod(p["shape"]))
        packed = base64.b64decode(p["bits"], validate=True)
        if len(packed) != -(-n // 8):  # unpackbits would pad a short one with zeros: wrong answers
            raise ValueError(f"{len(packed)} bytes of bits for a {p['shape']} matrix")
        bits = np.unpackbits(np.frombuffer(packed, dtype=np.uint8), count=n)
        out.append(bits.astype(bool).reshape(p["shape"]))
    return out


def _artifacts(client, run_id: str, tmp: Path) -> dict[str, dict]:
    """The run's evaluation artifacts that the report reads: path -> packed matrices or parsed JSON."""
    found: dict[str, dict] = {}
    labels = [a.path for a in client.list_artifacts(run_id, "eval") if a.is_dir]
    for label_dir in labels:
        for a in client.list_artifacts(run_id, label_dir):
            m = ARTIFACT.match(a.path)
            if m is None:
                continue
            local = Path(client.download_artifacts(run_id, a.path, str(tmp)))
            if m["kind"] == "correct.npz":
                found[a.path] = {"matrices": _pack(load.correctness_file(local))}
            else:
                found[a.path] = {"json": json.loads(local.read_text())}
    return found


def export(client, source: str, experiment: str, out: Path) -> dict[str, int]:
    """Write the snapshot of every active run of ``experiment`` (comma-separated names: several) to
    ``out``; returns counts (runs, metric points, artifacts) for the one line the CLI prints."""
    import tempfile

    experiments = []
    for name in load.experiment_names(experiment):
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise ReportError(f"--export: no experiment {name!r} in {load.redact(source)}")
        experiments.append({"id": exp.experiment_id, "name": exp.name})
    runs = load.fetch_runs(client, experiment)
    if not runs:
        raise ReportError(f"--export: experiment(s) {experiment!r} hold no runs in {load.redact(source)}")
    records, points, blobs = [], 0, {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in sorted(runs, key=lambda r: r.info.run_id):
            run_id = r.info.run_id
            latest = dict(r.data.metrics)
            # each history in MLflow's order of (step, time); the times themselves are not kept
            history = {}
            for key in filter(kept_history, latest):
                logged = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
                history[key] = [[m.step, m.value] for m in logged]
            files = {}
            # an artifact is stored once however many runs logged it: every run of a study evaluates the same
            # base model on the same problems and seeds
            for name, entry in _artifacts(client, run_id, Path(tmp) / run_id).items():
                digest = hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()[:16]
                blobs[digest] = entry
                files[name] = digest
            points += sum(len(h) for h in history.values())
            info = r.info
            records.append(
                {
                    "info": {
                        "run_id": run_id,
                        "run_name": info.run_name,
                        "experiment_id": info.experiment_id,
                        "user_id": info.user_id,
                        "status": info.status,
                        "start_time": info.start_time,
                        "end_time": info.end_time,
                        "lifecycle_stage": info.lifecycle_stage,
                    },
                    "tags": dict(r.data.tags),
                    "params": dict(r.data.params),
                    "metrics": latest,
                    "history": history,
                    "artifacts": files,
                }
            )
    doc = {
        "format": FORMAT,
        "source": load.redact(source),
        "experiments": experiments,
        "runs": records,
        "artifacts": dict(sorted(blobs.items())),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    # keys in the store's order, not sorted: a table's columns follow the order its metrics were logged in
    data = json.dumps(doc, separators=(",", ":")).encode()
    # a partial file of this process's own: two exports to one path leave one whole file, the last
    partial = out.with_name(f"{out.name}.{os.getpid()}.partial")
    with open(partial, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="") as gz:
        gz.write(data)
    os.replace(partial, out)
    return {"runs": len(records), "points": points, "artifacts": len(blobs)}


def damage(doc: dict) -> str | None:
    """What a snapshot lacks of what ``export`` writes (a part of a run, a field of its info, an artifact
    it names), or None: read before any of it is used, so a damaged file is one line, not a KeyError."""
    for key in ("source", "experiments", "runs", "artifacts"):
        if key not in doc:
            return f"no {key!r}"
    for e in doc["experiments"]:
        if not (isinstance(e, dict) and {"id", "name"} <= set(e)):
            return f"an experiment without id or name: {e!r:.80}"
    for i, rec in enumerate(doc["runs"]):
        if not isinstance(rec, dict):
            return f"run #{i} is not a record"
        info = rec.get("info")
        name = info.get("run_id", f"#{i}") if isinstance(info, dict) else f"#{i}"
        part = next((p for p in RUN_PARTS if not isinstance(rec.get(p), dict)), None)
        if part is not None:
            return f"run {name} has no {part}"
        field = next((f for f in INFO_FIELDS if f not in info), None)
        if field is not None:
            return f"run {name} has no info.{field}"
        blob = next(((a, d) for a, d in rec["artifacts"].items() if d not in doc["artifacts"]), None)
        if blob is not None:
            return f"run {name}'s artifact {blob[0]} is blob {blob[1]}, which the file does not hold"
    return None


class SnapshotClient:
    """The read-only calls ``analysis`` makes of an ``MlflowClient``, answered from a snapshot file."""

    def __init__(self, path: Path) -> None:
        from mlflow.entities import Experiment, Metric, Param, Run, RunData, RunInfo, RunTag

        self.path = Path(path)
        if not self.path.is_file():
            raise ReportError(f"--snapshot {self.path}: no such file")
        try:
            with gzip.open(self.path, "rt") as f:
                doc = json.load(f)
        except (EOFError, zlib.error) as e:
            raise ReportError(f"--snapshot {self.path}: cut short or corrupt ({e}): export it again") from e
        except (OSError, ValueError) as e:
            raise ReportError(f"--snapshot {self.path}: not a file sage-report --export wrote ({e})") from e
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ReportError(
                f"--snapshot {self.path}: format {doc.get('format') if isinstance(doc, dict) else None!r}, "
                f"this sage-report reads format {FORMAT}"
            )
        lacking = damage(doc)
        if lacking:
            raise ReportError(
                f"--snapshot {self.path}: {lacking}: not a whole file --export wrote, export it again"
            )
        self.source = doc["source"]
        self._experiments = [Experiment(e["id"], e["name"], "", "active") for e in doc["experiments"]]
        self._runs, self._history, self._artifacts = {}, {}, {}
        for rec in doc["runs"]:
            i = rec["info"]
            run_id = i["run_id"]
            info = RunInfo(
                run_id=run_id,
                experiment_id=i["experiment_id"],
                user_id=i["user_id"],
                status=i["status"],
                start_time=i["start_time"],
                end_time=i["end_time"],
                lifecycle_stage=i["lifecycle_stage"],
                run_name=i["run_name"],
            )
            # a run's latest values (what ``Run.data.metrics`` answers); their steps and times are not kept
            metrics = [Metric(k, v, 0, 0) for k, v in rec["metrics"].items()]
            data = RunData(
                metrics=metrics,
                params=[Param(k, v) for k, v in rec["params"].items()],
                tags=[RunTag(k, v) for k, v in rec["tags"].items()],
            )
            self._runs[run_id] = Run(info, data)
            # the stored order stands for the logging times: a later point of one step stays the later one
            self._history[run_id] = {
                k: [Metric(k, v, t, s) for t, (s, v) in enumerate(points)]
                for k, points in rec["history"].items()
            }
            blobs = doc["artifacts"]
            self._artifacts[run_id] = {name: blobs[digest] for name, digest in rec["artifacts"].items()}

    # experiments
    def search_experiments(self, *args, **kwargs) -> list:
        return list(self._experiments)

    def get_experiment_by_name(self, name: str):
        return next((e for e in self._experiments if e.name == name), None)

    # runs
    def get_run(self, run_id: str):
        if run_id not in self._runs:
            raise ReportError(f"run {run_id} is not in the snapshot {self.path}")
        return self._runs[run_id]

    def search_runs(
        self,
        experiment_ids: Sequence[str],
        filter_string: str = "",
        run_view_type: int = 1,
        max_results: int = 1000,
        order_by: Sequence[str] | None = None,
        page_token: str | None = None,
    ):
        from mlflow.store.entities.paged_list import PagedList
        from mlflow.utils.search_utils import SearchUtils

        runs = [r for r in self._runs.values() if r.info.experiment_id in set(experiment_ids)]
        runs = SearchUtils.filter(runs, filter_string)
        runs = SearchUtils.sort(runs, order_by or [])
        page, token = SearchUtils.paginate(runs, page_token, max_results)
        return PagedList(page, token)

    def get_metric_history(self, run_id: str, key: str) -> list:
        self.get_run(run_id)
        if key not in self._history[run_id]:
            if key in self._runs[run_id].data.metrics:
                raise ReportError(
                    f"the snapshot {self.path} keeps only the latest value of {key!r} (run {run_id}); its "
                    f"histories: {', '.join(HISTORY_NAMES)}, train/guide/*, curves, periodic pass@1, buckets"
                )
            return []  # never logged: as MLflow answers
        return list(self._history[run_id][key])

    # artifacts
    def list_artifacts(self, run_id: str, path: str | None = None) -> list:
        from mlflow.entities import FileInfo

        self.get_run(run_id)
        prefix = f"{path.rstrip('/')}/" if path else ""
        entries: dict[str, bool] = {}
        for name in self._artifacts[run_id]:
            if name.startswith(prefix):
                head, sep, _ = name[len(prefix) :].partition("/")
                entries[prefix + head] = entries.get(prefix + head, False) or bool(sep)
        return [FileInfo(p, is_dir, None) for p, is_dir in sorted(entries.items())]

    def download_artifacts(self, run_id: str, path: str, dst_path: str | None = None) -> str:
        import tempfile

        self.get_run(run_id)
        if path not in self._artifacts[run_id]:
            raise ReportError(f"the snapshot {self.path} holds no artifact {path!r} of run {run_id}")
        entry = self._artifacts[run_id][path]
        local = Path(dst_path or tempfile.mkdtemp()) / path
        local.parent.mkdir(parents=True, exist_ok=True)
        try:
            if "matrices" in entry:
                with open(local, "wb") as f:
                    np.savez(f, *_unpack(entry["matrices"]))
            else:
                local.write_text(json.dumps(entry["json"]))
        except (KeyError, TypeError, ValueError) as e:  # binascii.Error is a ValueError
            raise ReportError(
                f"--snapshot {self.path}: run {run_id}'s artifact {path} is damaged ({e!r})"
            ) from e
        return str(local)

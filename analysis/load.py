"""MLflow -> tidy pandas frames. The only module of ``analysis/`` that talks to MLflow, with
``analysis.snapshot`` (the same reads answered from a committed file).

Why frames: every table and figure is a function of these frames, so the tests can check values on
hand-made frames and against what MLflow recorded, without a second path to the numbers.

Which runs make one table row: runs with the same method label (tag ``method``, or derived from the
``algorithm``/``divergence``/``guide`` tags) AND the same resolved config apart from the seed and the keys
that change no result (``sage.run_folder.NO_RESULT_KEYS``). A run's config is its latest attempt's (an
extended run's ``trl.max_steps`` is its ``resumed.trl.max_steps`` tag). Runs of one method whose configs
differ (e.g. a threshold x ratio grid of GRPO + Branch in the same experiment) become separate rows named by
the params that differ, never one row averaged over different settings.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from sage.run_folder import NO_RESULT_KEYS, matches
from sage.run_names import derived_method
from sage.tracking import GROUP_TAGS, eval_tag, redact, resolve_uri


class ReportError(Exception):
    """A one-line reason why (part of) the report cannot be built."""


# Display names of the conf/experiment/ presets, in the order of the paper's tables (Tables 1, 3).
METHOD_NAMES = {
    "base": "base",
    "grpo": "GRPO",
    "grpo_nokl": "GRPO w/o KL",
    "grpo_fkl": "GRPO + forward KL",
    "grpo_random": "GRPO + Random",
    "grpo_token": "GRPO + Token",
    "grpo_branch": "GRPO + Branch",
    "grpo_fork": "GRPO + fork oracle",
    "grpo_fork_rare": "GRPO + rare-token oracle",
    "grpo_strong_kl": "GRPO, 1.4x beta",
    "bnpo": "BNPO w/o KL",
    "bnpo_branch": "BNPO + Branch",
    "dapo": "DAPO w/o KL",
    "dapo_kl": "DAPO",
    "dapo_branch": "DAPO + Branch",
}
ROW_ORDER = tuple(METHOD_NAMES.values())
ALGORITHM_NAMES = {"dr_grpo": "Dr.GRPO"}  # the others are their option name in capitals
DIVERGENCE_SUFFIX = {
    "reverse_kl": "",
    "none": " w/o KL",
    "forward_kl": " + forward KL",
    "sequence_kl": " + sequence KL",
}
# Params that differ between seeds of one experiment by design, and (sage.run_folder.NO_RESULT_KEYS) those
# that change no number a run reports, such as trl.save_steps; any other difference splits a row.
SEED_PARAMS = ("seed", "method")


class Key:
    """A logged metric's name (sage.metrics.metric_name: ``<figure>/<label>/<dataset>``), read with its
    parts; stores written before that naming (``eval/<label>/<dataset>/<figure>``) are read too, so no
    recorded run drops out of a report."""

    def __init__(self, figure: str, label: str = r"(?P<label>base|trained)") -> None:
        dataset = r"(?P<dataset>[^/]+)"
        self.patterns = (
            re.compile(f"^{figure}/{label}/{dataset}$"),
            re.compile(f"^eval/{label}/{dataset}/{figure}$"),  # the earlier layout
        )

    def match(self, key: str) -> re.Match | None:
        return next((m for p in self.patterns if (m := p.match(key))), None)


EVAL_KEY = Key(r"pass_at_(?P<k>\d+)(?P<std>_std)?")
CURVE_KEY = Key("pass_at_k_curve")
PERIODIC_KEY = Key("pass_at_1", label="periodic")
# logged by sage.eval.analyses beside each evaluation
ANALYSIS_KEY = Key(r"(?P<kind>pattern|strategy|tier|rare_share)/(?P<name>[^/]+(?:/pass_at_\d+)?)")


def open_existing_store(uri: str | None):
    """MlflowClient on ``uri`` (else $MLFLOW_TRACKING_URI, else the embedded store sage-train writes to).
    A SQLite store that does not exist is an error: MLflow would silently create an empty one."""
    from mlflow.tracking import MlflowClient

    resolved = resolve_uri(uri)
    if resolved.startswith("sqlite:///") and not Path(resolved.removeprefix("sqlite:///")).exists():
        raise ReportError(
            f"no MLflow store at {redact(resolved)}: pass --tracking-uri or set MLFLOW_TRACKING_URI"
        )
    return MlflowClient(tracking_uri=resolved), resolved


def fetch_runs(client, experiment: str, run_ids: Sequence[str] = (), filter_string: str = "") -> list:
    """The runs of ``experiment`` (optionally narrowed by an MLflow filter string), or exactly ``run_ids``.
    ``experiment`` may name several experiments separated by commas: one table can then reuse runs another
    grid already made (Table 4's cosine rows are Table 1's guided runs), with the filter applied to all."""
    if run_ids:
        return [client.get_run(r) for r in run_ids]
    ids = []
    for name in experiment_names(experiment):
        exp = client.get_experiment_by_name(name)
        if exp is None:
            names = sorted(e.name for e in client.search_experiments())
            listed = ", ".join(names) or "none"
            raise ReportError(f"no experiment {name!r} in this store (experiments there: {listed})")
        ids.append(exp.experiment_id)
    runs, token = [], None
    while True:
        page = client.search_runs(ids, filter_string, max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def experiment_names(experiment: str) -> list[str]:
    """``--experiment a,b`` -> ["a", "b"] (each once, in the order given)."""
    names = list(dict.fromkeys(n.strip() for n in experiment.split(",") if n.strip()))
    if not names:
        raise ReportError(f"--experiment {experiment!r} names no experiment")
    return names


def method_label(tags: dict[str, str], params: dict[str, str], run_id: str) -> str:
    """The row name of a run: its ``method`` preset's display name, else one derived from its group tags
    (grpo + reverse_kl + none -> GRPO, + none -> GRPO w/o KL, + branch -> GRPO + Branch)."""
    groups = [tags.get(g) for g in ("algorithm", "divergence", "guide")]
    derived = None not in groups and tags.get("method") == derived_method(*groups)
    if "method" in tags and not derived:  # a derived method keeps the label its groups give below
        return METHOD_NAMES.get(tags["method"], tags["method"])
    if params.get("trl.max_steps") == "0":
        return "base"
    missing = [g for g in ("algorithm", "divergence", "guide") if g not in tags]
    if missing:
        raise ReportError(f"run {run_id} has no 'method' tag and no {'/'.join(missing)} tag to name it by")
    algorithm = ALGORITHM_NAMES.get(tags["algorithm"], tags["algorithm"].upper())
    divergence = DIVERGENCE_SUFFIX.get(tags["divergence"], f" + {tags['divergence']}")
    guide = "" if tags["guide"] == "none" else f" + {tags['guide'].capitalize()}"
    return algorithm + divergence + guide


def run_params(params: dict[str, str], tags: dict[str, str]) -> dict[str, str]:
    """A run's config as its latest attempt had it. MLflow params are write-once: a resume that changed a
    value (``resume=true trl.max_steps=4`` on a 2-step run) records it as the tag ``resumed.<key>``, which
    wins, so the run is labelled and grouped by what its model had."""
    resumed = {k.removeprefix("resumed."): v for k, v in tags.items() if k.startswith("resumed.")}
    return {**params, **resumed}


def runs_frame(runs: Sequence) -> pd.DataFrame:
    """One line per run: ids, status, kind, seed, method label, base model, commit, tags and params."""
    rows = []
    for r in runs:
        tags, params = dict(r.data.tags), run_params(r.data.params, r.data.tags)
        kind = tags.get("sage.kind", "")
        if kind == "train" and not tags.get("seed", "").lstrip("-").isdigit():
            raise ReportError(f"sage-train run {r.info.run_id} has no integer 'seed' tag")
        train = kind == "train"  # other runs (sage-eval's, seed "none") are listed, then left out
        rows.append(
            {
                "run_id": r.info.run_id,
                "status": r.info.status,
                "kind": kind,
                "seed": int(tags["seed"]) if train else None,
                "method": method_label(tags, params, r.info.run_id) if train else tags.get("method", kind),
                "base_model": tags.get("base_model"),
                "git_commit": tags.get("git_commit", "unknown"),
                "divergence": tags.get("divergence"),
                "guide": tags.get("guide"),
                "start_time": r.info.start_time,
                "tags": tags,
                "params": params,
                "metrics": dict(r.data.metrics),
            }
        )
    columns = [
        "run_id",
        "status",
        "kind",
        "seed",
        "method",
        "base_model",
        "git_commit",
        "divergence",
        "guide",
        "start_time",
        "tags",
        "params",
        "metrics",
    ]
    return pd.DataFrame(rows, columns=columns)


def varying_params(params: Sequence[dict[str, str]], ignore: Sequence[str] = ()) -> list[str]:
    """Params whose value differs between the given runs, other than those that differ by design. Only
    keys every run has count: a config field added by a later commit does not split runs into rows."""
    keys = sorted(set(params[0]).intersection(*params[1:])) if params else []
    return [
        k
        for k in keys
        if k not in SEED_PARAMS
        and k not in ignore
        and not matches(k, NO_RESULT_KEYS)
        and not all(p.get(k) == p.get("seed") for p in params)  # follows the seed (e.g. guide.seed: ${seed})
        and len({p.get(k) for p in params}) > 1
    ]


def assign_rows(frame: pd.DataFrame, ignore: Sequence[str] = ()) -> pd.Series:
    """Row name of every run: its method label, plus ``[key=value, ...]`` for the params in which runs of
    the same method differ (see the module docstring). A config group chosen differently (its ``_target_``
    differs) is named by the group's choice, as the command line and the run's tag say it:
    ``schedule=constant`` rather than the class path."""
    out = pd.Series(index=frame.index, dtype=object)
    tags = frame["tags"] if "tags" in frame else pd.Series([{}] * len(frame), index=frame.index)
    for label, group in frame.groupby("method", sort=False):
        keys = varying_params(list(group["params"]), ignore)
        for i, p in group["params"].items():
            named = [_setting(k, p, tags[i]) for k in keys]
            out[i] = label if not keys else f"{label} [{', '.join(dict.fromkeys(named))}]"
    return out


def _setting(key: str, params: dict[str, str], tags: dict[str, str]) -> str:
    group = key.removesuffix("._target_")
    if key.endswith("._target_") and group in GROUP_TAGS and group in tags:
        return f"{group}={tags[group]}"
    return f"{key}={params.get(key)}"


def one_run_per_seed(frame: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The latest run of each (row, seed); repeated runs are named in the notes, not averaged in (they would
    weigh that seed twice)."""
    ordered = frame.sort_values("start_time", ascending=False)
    kept = ordered.drop_duplicates(["row", "seed"])
    notes = [
        f"{row} seed {seed}: {len(g)} runs, only the latest ({g.iloc[0]['run_id']}) is used"
        for (row, seed), g in ordered.groupby(["row", "seed"], sort=False)
        if len(g) > 1
    ]
    return kept.sort_index(), notes


def latest_evaluation(tags: dict[str, str], label: str, dataset: str) -> dict | None:
    """What a run's latest evaluation of ``label`` on ``dataset`` logged (step, ks, n_samples, seeds), as
    its tag says; None for a run logged before the tag was kept."""
    recorded = tags.get(eval_tag(label, dataset))
    return json.loads(recorded) if recorded else None


def _of_latest_evaluation(
    tags: dict[str, str], label: str, dataset: str, k: int, std: bool, key: str = ""
) -> bool:
    """A pass@k point the run's latest evaluation logged: a re-evaluation under other settings leaves the
    earlier one's points at other ks (and its std, with more seeds) in MLflow, never to be joined to it;
    the tag's ``stale`` list (sage.tracking.Tracker.log_eval) names them."""
    latest = latest_evaluation(tags, label, dataset)
    if latest is None:
        return True
    return k in latest["ks"] and not (std and latest["seeds"] == 1) and key not in latest.get("stale", ())


TIER_K = re.compile(r"^[^/]+/pass_at_(?P<k>\d+)$")


def _of_latest_analysis(tags: dict[str, str], key: str, m: re.Match) -> bool:
    """An analysis figure the run's latest evaluation of its label and dataset logged: not named stale by
    its tag, and a tier's pass@k only at k = 1 and k = n of that evaluation (``sage.eval.analyses
    .tier_figures``), so that an earlier evaluation's pass@n at another n is never read beside it (stores
    written before the stale list was kept)."""
    latest = latest_evaluation(tags, m["label"], m["dataset"])
    if latest is None:
        return True
    if key in latest.get("stale", ()):
        return False
    tier_k = TIER_K.match(m["name"]) if m["kind"] == "tier" else None
    return tier_k is None or int(tier_k["k"]) in {1, int(latest["n_samples"])}


# What names an evaluation's settings in a row: the fields of its tag (sage.tracking.eval_tag)...
EVAL_TAG_SETTINGS = {"n_samples": "n_samples", "problems": "problems", "seeds": "eval seeds"}
# ...and the eval.* params, but for those that change which figures are logged or how fast, not their values
EVAL_NOT_SETTINGS = (
    "eval.ks",
    "eval.batch_size",
    "eval.vllm_*",
    "eval.at_end",
    "eval.every_steps",
    "eval.every_n_samples",
    "eval.perplexity_*",
)


def evaluation_settings(tags: dict[str, str], label: str) -> dict[str, str]:
    """The settings of a run's latest evaluation of ``label`` on each dataset, as its tags record them:
    {"<dataset> n_samples": "4", "<dataset> problems": "20", "<dataset> eval seeds": "1"}."""
    prefix = eval_tag(label, "")
    out = {}
    for key, value in sorted(tags.items()):
        if key.startswith(prefix):
            record = json.loads(value)
            for field, name in EVAL_TAG_SETTINGS.items():
                if field in record:
                    out[f"{key.removeprefix(prefix)} {name}"] = str(record[field])
    return out


def evaluation_params(params: Sequence[dict[str, str]]) -> list[str]:
    """The eval.* params in which the given runs differ that change an evaluation's numbers."""
    return [k for k in varying_params(params) if k.startswith("eval.") and not matches(k, EVAL_NOT_SETTINGS)]


def with_settings(row: str, settings: Sequence[str]) -> str:
    """``GRPO [a=1]`` + ``b=2`` -> ``GRPO [a=1, b=2]``; ``base`` + ``b=2`` -> ``base [b=2]``."""
    if not settings:
        return row
    if row.endswith("]") and " [" in row:
        return f"{row[:-1]}, {', '.join(settings)}]"
    return f"{row} [{', '.join(settings)}]"


def split_by_evaluation(frame: pd.DataFrame, label: str | None = None) -> tuple[pd.Series, list[str]]:
    """Row names in which a row's runs whose latest evaluations differ in settings (samples per problem,
    problems, evaluation seeds, as ``evaluation_settings`` reads them) become rows of their own, named by
    those settings, and one note per row split naming its runs: a row never averages evaluations of
    different settings. ``label``: the evaluation read (default: base for method=base runs, else
    trained). Settings some runs do not record (runs logged before the tag) split nothing."""
    rows = frame["row"].copy()
    notes = []
    for row, group in frame.groupby("row", sort=False):
        settings = {
            i: evaluation_settings(
                group.at[i, "tags"], label or ("base" if group.at[i, "method"] == "base" else "trained")
            )
            for i in group.index
        }
        shared = set.intersection(*(set(s) for s in settings.values()))
        keys = sorted(k for k in shared if len({s[k] for s in settings.values()}) > 1)
        if not keys:
            continue
        for i, s in settings.items():
            rows[i] = with_settings(row, [f"{k}={s[k]}" for k in keys])
        named = rows[group.index]
        parts = [
            f"{name} (runs {', '.join(frame.loc[named[named == name].index, 'run_id'])})"
            for name in dict.fromkeys(named)
        ]
        notes.append(
            f"{row} is split into {len(parts)} rows because its runs' latest evaluations differ in "
            f"{', '.join(keys)}: {'; '.join(parts)}"
        )
    return rows, notes


def eval_frame(runs: pd.DataFrame) -> pd.DataFrame:
    """Logged pass@k points of each run's latest evaluation: run_id, label (base|trained), dataset, k,
    value, std (over eval seeds)."""
    points: dict[tuple, dict] = {}
    tags_of = runs["tags"] if "tags" in runs else pd.Series([{}] * len(runs), index=runs.index)
    for run_id, metrics, tags in zip(runs["run_id"], runs["metrics"], tags_of, strict=True):
        for key, value in metrics.items():
            m = EVAL_KEY.match(key)
            if m and _of_latest_evaluation(tags, m["label"], m["dataset"], int(m["k"]), bool(m["std"]), key):
                cell = points.setdefault((run_id, m["label"], m["dataset"], int(m["k"])), {})
                cell["std" if m["std"] else "value"] = value
    rows = [
        {"run_id": r, "label": lab, "dataset": ds, "k": k, "value": v.get("value"), "std": v.get("std")}
        for (r, lab, ds, k), v in points.items()
    ]
    return pd.DataFrame(rows, columns=["run_id", "label", "dataset", "k", "value", "std"])


def history_frame(client, run_ids: Sequence[str], key: str) -> pd.DataFrame:
    """Every logged value of one metric: run_id, step, value (sorted by step)."""
    rows = [
        {"run_id": r, "step": m.step, "value": m.value}
        for r in run_ids
        for m in client.get_metric_history(r, key)
    ]
    frame = pd.DataFrame(rows, columns=["run_id", "step", "value"])
    return frame.sort_values(["run_id", "step"], kind="stable")


def curve_frame(client, runs: pd.DataFrame) -> pd.DataFrame:
    """The logged pass@k curves (step = k): run_id, label, dataset, k, value. A run extended after its
    evaluation (``resume=true`` with a larger ``trl.max_steps``) logs its trained curve again at the same k,
    and MLflow keeps both points: the latest one per k is the curve of the run's final model. A run
    re-evaluated with fewer samples keeps the earlier curve's points beyond the new n: they are left out."""
    parts = []
    tags_of = runs["tags"] if "tags" in runs else pd.Series([{}] * len(runs), index=runs.index)
    for run_id, metrics, tags in zip(runs["run_id"], runs["metrics"], tags_of, strict=True):
        for key in metrics:
            m = CURVE_KEY.match(key)
            if m:
                points = sorted(client.get_metric_history(run_id, key), key=lambda p: (p.step, p.timestamp))
                latest_eval = latest_evaluation(tags, m["label"], m["dataset"])
                if latest_eval is not None:
                    points = [p for p in points if p.step <= latest_eval["n_samples"]]
                latest = {p.step: p.value for p in points}  # later points of the same k overwrite
                h = pd.DataFrame({"run_id": run_id, "k": list(latest), "value": list(latest.values())})
                parts.append(h.assign(label=m["label"], dataset=m["dataset"]))
    columns = ["run_id", "label", "dataset", "k", "value"]
    return pd.concat(parts)[columns] if parts else pd.DataFrame(columns=columns)


BUCKET_KEY = re.compile(r"^train/anchor_buckets/(?P<bucket>[^/]+)/(?P<stat>[^/]+)$")
# the bucket statistics sage-report tabulates ("Where the anchor acted"), with their tables' titles
BUCKET_TABLES = (
    ("anchor_grad_share", "the anchor's share of the per-token gradient signal by token-entropy bucket, mean "
     "over the logged training steps"),
    ("q", "the guide's mean q by token-entropy bucket, mean over the logged training steps"),
)  # fmt: skip


def bucket_frame(client, runs: pd.DataFrame, stats: Sequence[str]) -> pd.DataFrame:
    """Where the anchor acted during training (``train/anchor_buckets/<bucket>/<stat>``, sage.objective.
    buckets) for the statistics ``stats``: run_id, bucket, stat, step, value; a step whose bucket was empty
    (NaN) is left out."""
    parts = []
    for run_id, metrics in zip(runs["run_id"], runs["metrics"], strict=True):
        for key in metrics:
            m = BUCKET_KEY.match(key)
            if m and m["stat"] in stats:
                h = history_frame(client, [run_id], key)
                parts.append(h[h["value"].notna()].assign(bucket=m["bucket"], stat=m["stat"]))
    columns = ["run_id", "bucket", "stat", "step", "value"]
    return pd.concat(parts)[columns] if parts else pd.DataFrame(columns=columns)


def periodic_frame(client, runs: pd.DataFrame) -> pd.DataFrame:
    """Held-out pass@1 during training (``pass_at_1/periodic/<dataset>``): run_id, dataset, step,
    value."""
    parts = []
    for run_id, metrics in zip(runs["run_id"], runs["metrics"], strict=True):
        for key in metrics:
            m = PERIODIC_KEY.match(key)
            if m:
                parts.append(history_frame(client, [run_id], key).assign(dataset=m["dataset"]))
    columns = ["run_id", "dataset", "step", "value"]
    return pd.concat(parts)[columns] if parts else pd.DataFrame(columns=columns)


def analysis_frame(runs: pd.DataFrame) -> pd.DataFrame:
    """What the evaluation's analysis step logged (``<pattern|strategy|rare_share>/<name>/<label>/<dataset>``,
    ``tier/<tier>/pass_at_<k>/<label>/<dataset>``), of each run's latest evaluation only, as ``eval_frame``
    reads pass@k: run_id, label, dataset, kind, name, value."""
    tags_of = runs["tags"] if "tags" in runs else pd.Series([{}] * len(runs), index=runs.index)
    rows = [
        {"run_id": run_id, **m.groupdict(), "value": value}
        for run_id, metrics, tags in zip(runs["run_id"], runs["metrics"], tags_of, strict=True)
        for key, value in metrics.items()
        if (m := ANALYSIS_KEY.match(key)) and _of_latest_analysis(tags, key, m)
    ]
    return pd.DataFrame(rows, columns=["run_id", "label", "dataset", "kind", "name", "value"])


def logged_artifact(client, run_id: str, label: str, file: str, dst: Path) -> Path | None:
    """The run's artifact ``eval/<label>/<file>`` downloaded under ``dst``, or None when it was not logged."""
    name = f"eval/{label}/{file}"
    if name not in {a.path for a in client.list_artifacts(run_id, f"eval/{label}")}:
        return None
    return Path(client.download_artifacts(run_id, name, str(dst / run_id)))


def perplexities(client, run_id: str, label: str, dataset: str, dst: Path) -> list[float] | None:
    """The per-sample perplexities under the base model the analysis step logged, or None."""
    path = logged_artifact(client, run_id, label, f"{label}_{dataset}_perplexity.json", dst)
    return None if path is None else json.loads(path.read_text())


def correctness(client, run_id: str, label: str, dataset: str, dst: Path) -> list[np.ndarray] | None:
    """The boolean (problems x samples) correctness matrices of every evaluation seed (in seed order) that
    ``Tracker.log_eval`` logged for ``label`` on ``dataset``, or None."""
    path = logged_artifact(client, run_id, label, f"{label}_{dataset}_correct.npz", dst)
    return None if path is None else correctness_file(path)


def correctness_file(path: Path) -> list[np.ndarray]:
    """The matrices of a ``<label>_<dataset>_correct.npz`` file, in evaluation-seed order."""
    with np.load(path) as npz:
        # savez names positional arrays arr_0, arr_1, ...: numeric order, not the archive's
        keys = sorted(npz.files, key=lambda f: int(f.removeprefix("arr_")))
        return [npz[f].astype(bool) for f in keys]


def problem_ids(client, run_id: str, label: str, dataset: str, dst: Path) -> list[str] | None:
    """The ids of the problems of ``correctness``'s matrices, in their order, as ``Tracker.log_eval`` logged
    them (``<label>_<dataset>_problems.json``), or None (a run evaluated before they were logged)."""
    path = logged_artifact(client, run_id, label, f"{label}_{dataset}_problems.json", dst)
    return None if path is None else json.loads(path.read_text())

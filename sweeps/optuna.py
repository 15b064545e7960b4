"""An Optuna 5 sweeper behind Hydra's Sweeper interface (hydra-optuna-sweeper pins optuna<3); registered
for Hydra as ``hydra/sweeper=optuna`` by hydra_plugins/sage_optuna_sweeper.

    sage-train -m hparams_search=branch_threshold_ratio [hydra/launcher=slurm]

How it runs a study:
- The search space is ``hydra.sweeper.params`` (usually from ``conf/hparams_search/<name>.yaml``) plus any
  sweep-syntax override on the command line; other overrides are passed unchanged to every trial. With
  ``choices_as: interval`` a choice of numbers (a paper grid's values) spans the interval from its lowest to
  its highest value, so a grid and an Optuna search share one space. Before anything is
  submitted, every range is checked and one trial config per choice value is composed locally, so a
  misspelt key or bad range fails with one line naming it.
- Trials are asked in batches of ``n_jobs`` and run through whichever Hydra launcher is selected (local
  processes, a SLURM array); each trial gets ``tracking.tags.study`` and ``tracking.tags.trial`` and runs
  in ``<sweep dir>/<study>/<trial number>`` (never in an earlier trial's folder, as a job number would be).
- The study lives in ``storage`` (SQLite file by default, any SQLAlchemy URL such as PostgreSQL), created or
  loaded by name. A study is one experiment: it records its search space and its fixed overrides (bar
  ``hydra.*`` and the keys that change no result), and a resume with another space or other fixed overrides
  is refused in one line naming the difference (another ``hydra.sweeper.study_name`` starts a new study).
  Re-running the same command resumes it: trials already finished count towards
  ``n_trials``; trials left RUNNING by a killed driver are marked FAIL and their params re-enqueued; a trial
  whose job failed is marked FAIL and retried up to ``max_retries`` times. Only one driver per study may run
  at a time (a second one would take the first one's running trials for lost ones).
- Objectives: each name in ``objectives`` is read from the metrics dict the task function returns; with
  ``weights`` they are combined into one value (sum of weight * metric). With several objectives the
  result is the Pareto front, printed and written to ``<sweep dir>/optimization_results.yaml``.
- Pruning: with a pruner and ``prune_on`` (a periodic metric, e.g. ``pass_at_1/periodic/arith_heldout``,
  with ``eval.every_steps`` set), every trial gets ``+callbacks.optuna_pruning`` (sage.train.callbacks.
  OptunaPruning with the study, the trial and this sweeper's pruner node): it reports that metric to the
  study at each periodic evaluation and stops the run when the pruner says so; the sweeper records the
  trial as PRUNED. Single objective only (Optuna does not prune multi-objective studies).
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn
from hydra.errors import CompactHydraException
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


class SweepError(CompactHydraException):
    """A sweep that cannot start or must stop; the message is one line naming the key at fault."""


def distribution(key: str, override: Override, choices_as: str = "points") -> Any:
    """A sweep override (``choice``, ``range``, ``interval``, ``int(interval)``, ``tag(log, interval)``) ->
    the Optuna distribution; with ``choices_as="interval"`` a choice of numbers becomes the interval between
    its extremes. A bad range raises SweepError naming the key."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    sweep = override.value()
    if isinstance(sweep, ChoiceSweep):
        choices = list(override.sweep_iterator())
        bad = [c for c in choices if not isinstance(c, bool | int | float | str) and c is not None]
        if not choices or bad:
            raise SweepError(f"sweep param {key}: choice() needs scalar values, got {sweep.list}")
        numbers = all(isinstance(c, int | float) and not isinstance(c, bool) for c in choices)
        if choices_as == "interval" and numbers and len(set(choices)) > 1:
            if all(isinstance(c, int) for c in choices):
                return IntDistribution(min(choices), max(choices))
            return FloatDistribution(float(min(choices)), float(max(choices)))
        return CategoricalDistribution(choices)
    if isinstance(sweep, RangeSweep):
        values = list(override.sweep_iterator())
        if not values:
            raise SweepError(f"sweep param {key}: range({sweep.start}, {sweep.stop}, {sweep.step}) is empty")
        return CategoricalDistribution(values)
    if isinstance(sweep, IntervalSweep):
        low, high, log_scale = sweep.start, sweep.end, "log" in sweep.tags
        if not low < high:
            raise SweepError(f"sweep param {key}: interval({low}, {high}) needs low < high")
        if log_scale and low <= 0:
            raise SweepError(f"sweep param {key}: a log interval needs low > 0, got {low}")
        if isinstance(low, int) and isinstance(high, int):
            return IntDistribution(low, high, log=log_scale)
        return FloatDistribution(float(low), float(high), log=log_scale)
    raise SweepError(f"sweep param {key}: {override.input_line} is not choice/range/interval")


def quote(value: Any) -> str:
    """A value (a scalar, or dicts and lists of them) as a Hydra override literal."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{quote(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(quote(v) for v in value) + "]"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)


DEFINITION_ATTR = "sage.definition"  # the study user attribute holding its space and fixed overrides


def study_definition(space: dict[str, Any], fixed: Sequence[str]) -> dict[str, Any]:
    """What makes a study one experiment: its searched keys with their distributions (Optuna's JSON) and
    its fixed overrides, as key -> value, bar ``hydra.*`` and the keys that change no result (where it
    logs, ``resume``, ...)."""
    from optuna.distributions import distribution_to_json

    from sage.run_folder import NO_RESULT_KEYS, matches

    parsed = OverridesParser.create().parse_overrides([str(o) for o in fixed])
    kept = {
        o.key_or_group: o.get_value_element_as_str()
        for o in parsed
        if not o.key_or_group.startswith(("hydra.", "hydra/")) and not matches(o.key_or_group, NO_RESULT_KEYS)
    }
    return {
        "space": {k: distribution_to_json(d) for k, d in sorted(space.items())},
        "fixed": dict(sorted(kept.items())),
    }


def definition_differences(stored: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Each way ``now`` differs from the study's ``stored`` definition, as ``key=now (the study's: was)``."""

    def shown(value: Any) -> str:
        if value is None:
            return "unset"
        try:  # a distribution, as a person reads it
            from optuna.distributions import json_to_distribution

            return repr(json_to_distribution(value))
        except (ValueError, TypeError, KeyError):
            return str(value)

    out = []
    for part, what in (("space", "searched over"), ("fixed", "")):
        was, is_ = stored.get(part, {}), now.get(part, {})
        for key in sorted(was.keys() | is_.keys()):
            if was.get(key) != is_.get(key):
                label = f"{key} {what} " if what else f"{key}="
                out.append(f"{label}{shown(is_.get(key))} (the study's: {shown(was.get(key))})")
    return out


class SageOptunaSweeper(Sweeper):
    def __init__(
        self,
        study_name: str,
        storage: str,
        n_trials: int,
        n_jobs: int,
        objectives: Sequence[str],
        weights: Sequence[float] | None,
        directions: Sequence[Any],
        params: dict[str, str],
        choices_as: Any,
        max_retries: int,
        max_failures: int,
        sampler: Any,
        pruner: Any,
        prune_on: str | None = None,
    ) -> None:
        # Hydra instantiates the sweeper recursively: sampler and pruner arrive built (the grid sampler as a
        # partial still waiting for its grid).
        self.study_name = study_name
        self.storage = storage
        self.n_trials = n_trials
        self.n_jobs = n_jobs
        self.objectives = list(objectives)
        self.weights = None if weights is None else [float(w) for w in weights]
        self.directions = [getattr(d, "value", str(d)) for d in directions]
        self.params = {str(k): str(v) for k, v in (params or {}).items()}
        self.choices_as = getattr(choices_as, "value", str(choices_as))
        self.max_retries = max_retries
        self.max_failures = max_failures
        self.sampler = sampler
        self.pruner = pruner
        self.prune_on = prune_on
        self.job_idx = 0
        self.space_keys: list[str] = []  # the searched keys, which name each trial's run (sage.grid)
        self.parent_id: str | None = None  # the study's MLflow parent run, opened by sweep()

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context = hydra_context
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    # ---------------------------------------------------------------- before anything is submitted
    def check_settings(self) -> None:
        if self.n_trials < 1 or self.n_jobs < 1:
            raise SweepError(
                f"hydra.sweeper.n_trials ({self.n_trials}) and n_jobs ({self.n_jobs}) must be >= 1"
            )
        if not self.objectives:
            raise SweepError("hydra.sweeper.objectives is empty: name at least one metric of the run")
        if self.weights is not None and len(self.weights) != len(self.objectives):
            raise SweepError(
                f"hydra.sweeper.weights has {len(self.weights)} entries for {len(self.objectives)} objectives"
            )
        n_values = 1 if self.weights is not None else len(self.objectives)
        if len(self.directions) != n_values:
            raise SweepError(
                f"hydra.sweeper.directions has {len(self.directions)} entries, the study has {n_values} "
                f"objective value(s) ({'weighted sum' if self.weights else ', '.join(self.objectives)})"
            )
        import optuna

        prunes = not isinstance(self.pruner, optuna.pruners.NopPruner)
        if prunes and self.prune_on is None:
            raise SweepError(
                "a pruner needs intermediate values: set hydra.sweeper.prune_on to a periodic metric "
                "(e.g. pass_at_1/periodic/arith_heldout) and eval.every_steps, "
                "or use hydra/sweeper/pruner=nop"
            )
        if self.prune_on is not None and n_values != 1:
            raise SweepError(
                f"hydra.sweeper.prune_on needs a single objective value (Optuna does not prune "
                f"multi-objective studies); this study has {n_values}: "
                "set hydra.sweeper.weights or one objective"
            )
        if self.prune_on is not None and not prunes:
            raise SweepError(
                "hydra.sweeper.prune_on is set but the pruner is nop: "
                "choose hydra/sweeper/pruner=median|hyperband"
            )

    def search_space(self, arguments: list[str]) -> tuple[dict[str, Any], list[str]]:
        """(key -> distribution, fixed overrides) from hydra.sweeper.params and the command line."""
        parser = OverridesParser.create()
        merged: dict[str, Override] = {}
        for key, value in self.params.items():
            try:
                (merged[key],) = parser.parse_overrides([f"{key}={value}"])
            except Exception as e:
                raise SweepError(
                    f"sweep param {key}: cannot parse {value!r}: {str(e).splitlines()[0]}"
                ) from e
        for o in parser.parse_overrides(arguments):  # the command line wins over the sweep file
            merged[o.get_key_element()] = o
        space, fixed = {}, []
        for key, o in merged.items():
            if o.is_sweep_override():
                space[key] = distribution(key, o, self.choices_as)
            else:
                fixed.append(o.input_line)
        if not space:
            raise SweepError(
                "nothing to search: hydra.sweeper.params (hparams_search=<name>) has no choice/range/interval"
            )
        return space, fixed

    def trial_folder(self, number: int) -> str:
        """A trial's folder in the sweep dir, ``<study>/<trial number>``: a study extended in the same sweep
        dir gives each new trial a folder of its own (a job number restarts at 0 with every driver, and
        would hand a new trial an old trial's finished run)."""
        from sage.run_folder import safe_name

        return f"{safe_name(self.study_name)}/{number}"

    def trial_overrides(self, fixed: list[str], params: dict[str, Any], number: int) -> list[str]:
        return [
            *fixed,
            *(f"{k}={quote(v)}" for k, v in params.items()),
            f"hydra.sweep.subdir={quote(self.trial_folder(number))}",
            f"++tracking.tags.study={quote(self.study_name)}",
            f"++tracking.tags.trial={quote(str(number))}",
            # the run is named by the searched values and nested under the study's parent run (sage.grid)
            f"tracking.name_keys=[{','.join(self.space_keys)}]",
            *([f"tracking.parent_run_id={self.parent_id}"] if self.parent_id else []),
            *([f"+callbacks.optuna_pruning={quote(self.pruning_node(number))}"] if self.prune_on else []),
        ]

    def pruning_node(self, number: int) -> dict[str, Any]:
        """The trial's pruning callback: it reports ``prune_on`` to trial ``number`` of the study and asks
        this sweeper's pruner (its config node: Optuna does not store the pruner with the study)."""
        return {
            "_target_": "sage.train.callbacks.OptunaPruning",
            "storage": self.storage,
            "study": self.study_name,
            "trial": number,
            "metric": self.prune_on,
            "pruner": OmegaConf.to_container(self.config.hydra.sweeper.pruner, resolve=True),
        }

    def compose_samples(self, space: dict[str, Any], fixed: list[str]) -> None:
        """Compose the trial config locally for the low end of every range and for each choice value."""
        from optuna.distributions import CategoricalDistribution

        low = {k: d.choices[0] if isinstance(d, CategoricalDistribution) else d.low for k, d in space.items()}
        samples = [low]
        for k, d in space.items():
            if isinstance(d, CategoricalDistribution):
                samples += [{**low, k: c} for c in d.choices[1:]]
            else:
                samples.append({**low, k: d.high})
        for s in samples:
            try:
                cfg = self.hydra_context.config_loader.load_sweep_config(
                    master_config=self.config, sweep_overrides=self.trial_overrides(fixed, s, 0)
                )
            except Exception as e:
                msg = " ".join(str(e).split("Config search path")[0].split())  # one line, no search path
                raise SweepError(f"a trial of this sweep does not compose ({s}): {msg}") from e
            from sage.config import final_metrics

            written = final_metrics(cfg)
            unknown = [o for o in self.objectives if o not in written]
            if unknown:  # else every trial would train and then fail on its missing objective
                shown = ", ".join(n for n in written if not n.split("/")[0].endswith("_std")) or "none"
                raise SweepError(
                    f"hydra.sweeper.objectives: {', '.join(unknown)} is not a metric a trial writes ({s}); "
                    f"its metrics.json holds {shown} (and their _std)"
                )
            if self.prune_on is not None:  # the trials must log the metric they will report
                from sage.config import ConfigError, check_callbacks

                try:
                    check_callbacks(cfg)
                except ConfigError as e:
                    raise SweepError(f"a trial of this sweep cannot be pruned ({s}): {e}") from e

    # ---------------------------------------------------------------- the study
    def create_study(self, space: dict[str, Any], fixed: Sequence[str] = ()):
        """The study, created or loaded by name; a loaded one must be the same experiment
        (``check_definition``)."""
        import optuna

        sampler = self.sampler
        if isinstance(sampler, functools.partial):  # the grid sampler: the grid is the space's choices
            grid = {k: getattr(d, "choices", None) for k, d in space.items()}
            if any(v is None for v in grid.values()):
                missing = [k for k, v in grid.items() if v is None]
                raise SweepError(
                    f"hydra/sweeper/sampler=grid needs choice()/range() params, not interval: {missing}"
                )
            sampler = sampler(search_space=grid)
        if self.storage.startswith("sqlite:///"):
            Path(self.storage.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        study = optuna.create_study(
            storage=self.storage,
            sampler=sampler,
            pruner=self.pruner,
            study_name=self.study_name,
            directions=self.directions,
            load_if_exists=True,
        )
        stored = [d.name.lower() for d in study.directions]
        if stored != self.directions:
            raise SweepError(
                f"study {self.study_name!r} in {self.storage} has directions {stored}, the config asks for "
                f"{self.directions}: use another hydra.sweeper.study_name or matching objectives"
            )
        self.check_definition(study, space, fixed)
        return study

    def check_definition(self, study, space: dict[str, Any], fixed: Sequence[str]) -> None:
        """A study is one experiment: its trials compare one search space under one config. The first
        driver records both in the study (``sage.definition``); a resume with another space or other fixed
        overrides is refused in one line naming the difference, before anything runs (its new trials would
        train under another config and share a Pareto front with the old ones; a retry of an old trial
        could fall outside the new space). A study made before definitions were recorded gets this one."""
        now = study_definition(space, fixed)
        stored = study.user_attrs.get(DEFINITION_ATTR)
        if stored is None:
            study.set_user_attr(DEFINITION_ATTR, now)
            return
        differences = definition_differences(stored, now)
        if differences:
            more = f"; {len(differences) - 6} more" if len(differences) > 6 else ""
            raise SweepError(
                f"study {self.study_name!r} in {self.storage} is another experiment: "
                f"{'; '.join(differences[:6])}{more}; resume it with its own space and overrides, "
                "or start a new study with another hydra.sweeper.study_name"
            )

    def recover_lost_trials(self, study) -> None:
        """Trials still RUNNING belong to a killed driver: mark them FAIL and run their params again."""
        from optuna.trial import TrialState

        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            log.warning(
                "trial %d was left running by a killed sweep: marked failed and re-enqueued", t.number
            )
            study.tell(t.number, state=TrialState.FAIL)
            study.enqueue_trial(dict(t.params), user_attrs={"retry_of": t.number, "attempt": 0})

    def values(self, metrics: Any, number: int) -> list[float]:
        if not isinstance(metrics, dict):
            raise SweepError(
                f"trial {number}: the task function returned {type(metrics).__name__}, not a dict"
            )
        missing = [m for m in self.objectives if m not in metrics]
        if missing:
            raise SweepError(
                f"trial {number}: objective(s) {missing} not in the run's metrics "
                f"({', '.join(sorted(metrics)) or 'none'}): set hydra.sweeper.objectives"
            )
        vals = [float(metrics[m]) for m in self.objectives]
        if self.weights is not None:
            return [sum(w * v for w, v in zip(self.weights, vals, strict=True))]
        return vals

    def sweep(self, arguments: list[str]) -> list[dict[str, Any]]:
        self.check_settings()
        space, fixed = self.search_space(arguments)
        self.space_keys = list(space)
        self.compose_samples(space, fixed)
        study = self.create_study(space, fixed)
        self.recover_lost_trials(study)

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        from sage.grid import close_parent, open_parent, study_key

        key = study_key(self.study_name, self.storage)
        self.parent_id = open_parent(self.config.tracking, key, name=f"study-{self.study_name}")
        try:
            best = self.run_study(study, space, fixed, sweep_dir)
        except BaseException:
            close_parent(self.config.tracking, self.parent_id, ok=False)
            raise
        close_parent(self.config.tracking, self.parent_id, ok=True)
        return best

    def run_study(self, study, space: dict[str, Any], fixed: list[str], sweep_dir: Path) -> list[dict]:
        """Ask, launch and tell until ``n_trials`` trials have finished; the best trials."""
        from optuna.trial import TrialState

        finished = (TrialState.COMPLETE, TrialState.PRUNED)
        done = len(study.get_trials(deepcopy=False, states=finished))
        log.info(
            "Study %s in %s: %d of %d trials finished, %d at a time; space %s",
            self.study_name,
            re.sub(r"://[^/@\s]+@", "://***@", self.storage),  # no password in the log
            done,
            self.n_trials,
            self.n_jobs,
            {k: repr(d) for k, d in space.items()},
        )
        failures = 0
        while done < self.n_trials:
            trials = [study.ask(space) for _ in range(min(self.n_jobs, self.n_trials - done))]
            batch = [self.trial_overrides(fixed, t.params, t.number) for t in trials]
            for i, t in enumerate(trials):
                t.set_user_attr("sweep_dir", str(sweep_dir))
                t.set_user_attr("job_num", self.job_idx + i)
                t.set_user_attr("job_dir", str(sweep_dir / self.trial_folder(t.number)))
            returns: Sequence[JobReturn] = self.launcher.launch(batch, initial_job_idx=self.job_idx)
            self.job_idx += len(batch)
            for t, ret in zip(trials, returns, strict=True):
                try:
                    metrics = ret.return_value
                except Exception as e:  # the job failed or was killed
                    failures += 1
                    study.tell(t, state=TrialState.FAIL)
                    attempt = int(t.user_attrs.get("attempt", 0))
                    log.error("trial %d failed: %s", t.number, " ".join(str(e).split())[:500])
                    if attempt < self.max_retries:
                        study.enqueue_trial(
                            dict(t.params), user_attrs={"retry_of": t.number, "attempt": attempt + 1}
                        )
                    continue
                if isinstance(metrics, dict) and "pruned_at_step" in metrics:
                    study.tell(t, state=TrialState.PRUNED)
                    done += 1
                    log.info("trial %d: %s pruned at step %d", t.number, t.params, metrics["pruned_at_step"])
                    continue
                try:
                    vals = self.values(metrics, t.number)
                except SweepError:
                    study.tell(t, state=TrialState.FAIL)
                    raise
                if any(math.isnan(v) for v in vals):
                    failures += 1
                    log.error("trial %d: an objective is NaN (%s); marked failed", t.number, vals)
                    study.tell(t, state=TrialState.FAIL)
                    continue
                study.tell(t, vals)
                done += 1
                log.info("trial %d: %s -> %s", t.number, t.params, vals)
            if failures >= self.max_failures:
                raise SweepError(
                    f"{failures} trials failed in this run (hydra.sweeper.max_failures={self.max_failures}); "
                    f"see the job logs in {sweep_dir}/.submitit"
                )
        return self.report(study, sweep_dir)

    def report(self, study, sweep_dir: Path) -> list[dict[str, Any]]:
        best = [
            {"number": t.number, "values": list(t.values), "params": dict(t.params)}
            for t in sorted(study.best_trials, key=lambda t: t.number)
        ]
        names = ["weighted"] if self.weights else self.objectives
        log.info(
            "Best trials of study %s (%s, %s):", self.study_name, ", ".join(names), "/".join(self.directions)
        )
        for b in best:
            log.info("  trial %d: %s  %s", b["number"], [round(v, 4) for v in b["values"]], b["params"])
        OmegaConf.save(
            OmegaConf.create(
                {
                    "study_name": self.study_name,
                    "storage": self.storage,
                    "objectives": names,
                    "directions": self.directions,
                    "best_trials": best,
                }
            ),
            sweep_dir / "optimization_results.yaml",
        )
        return best

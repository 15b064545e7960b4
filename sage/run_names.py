"""What a run is called and what method it is: its name (``run_name``), its method (``method_of``, a preset's
name or ``derived_method`` of its choices) and the line it prints as it starts (``what_trains``), read from
the config and the current Hydra job (``hydra_context``, ``job_overrides``)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def hydra_context() -> tuple[dict[str, str], dict[str, str]]:
    """(group choices, sweep tags) of the current Hydra job; empty outside a Hydra app."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}, {}
    hc = HydraConfig.get()
    choices = {
        k: str(v) for k, v in hc.runtime.choices.items() if not k.startswith("hydra/") and v is not None
    }
    sweep: dict[str, str] = {}
    if str(hc.mode) == "RunMode.MULTIRUN":
        sweep = {"grid": str(Path(hc.sweep.dir).resolve()), "job_num": str(hc.job.num)}
    return choices, sweep


def job_overrides() -> dict[str, str]:
    """The current Hydra job's command-line overrides, key -> value as typed; empty outside a Hydra app."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not HydraConfig.initialized():
        return {}
    parsed = OverridesParser.create().parse_overrides(list(HydraConfig.get().overrides.task))
    return {o.key_or_group: o.get_value_element_as_str() for o in parsed}


def run_name(cfg: DictConfig) -> str:
    """``tracking.run_name``, else what ran: ``<method>-s<seed>``, with the value of each of
    ``tracking.name_keys`` (the overrides that differ between the jobs of a grid or the trials of a study,
    named by sage's launchers and sweeper) and a study's trial number in between, e.g.
    ``grpo_branch-threshold0.3-ratio0.5-s2``. Never left to MLflow: its random name is drawn from the
    global RNG, which sage-train has already seeded, so every run of one seed got the same name."""
    if cfg.tracking.run_name:
        return str(cfg.tracking.run_name)
    choices, _ = hydra_context()
    method = method_of(cfg, choices) or choices.get("experiment") or "run"
    parts = [str(method)]
    given = job_overrides()
    keys = [k for k in cfg.tracking.name_keys if k != "seed"]
    short = [k.rsplit(".", 1)[-1] for k in keys]
    for key, name in zip(keys, short, strict=True):
        value = given.get(key, OmegaConf.select(cfg, key, default=None))
        if value is None or (key == "experiment" and value == method):  # the method already says it
            continue
        label = name if short.count(name) == 1 else key  # guide.beta and divergence.beta stay apart
        parts.append(f"{label}{value}")
    if "trial" in cfg.tracking.tags:
        parts.append(f"t{cfg.tracking.tags.trial}")
    if cfg.get("seed") is not None:
        parts.append(f"s{cfg.seed}")
    return "-".join(parts)


METHOD_GROUPS = ("algorithm", "divergence", "guide")  # what a method is: the groups a preset chooses


def method_of(cfg: DictConfig, choices: dict[str, str]) -> str | None:
    """The run's method: ``method`` (set by the experiment/ presets); else the preset that chooses exactly
    these algorithm, divergence and guide and nothing else (``guide=branch`` alone is ``grpo_branch``);
    else :func:`derived_method` of the choices; ``base`` for a run of no step. None outside a Hydra app
    that chose them."""
    if cfg.get("method"):
        return str(cfg.method)
    chosen = tuple(choices.get(g) for g in METHOD_GROUPS)
    if None in chosen:
        return None
    if OmegaConf.select(cfg, "trl.max_steps") == 0:  # nothing trained: the start model (as sage-report says)
        return "base"
    from sage.paths import CONF_DIR

    for path in sorted((Path(CONF_DIR) / "experiment").glob("*.yaml")):
        preset = OmegaConf.load(path)
        if set(preset) != {"defaults", "method"}:  # it sets more than the groups (a beta, a step count)
            continue
        groups = {}
        for entry in preset.defaults:
            for key, value in entry.items() if isinstance(entry, DictConfig) else ():
                groups[str(key).removeprefix("override /")] = str(value)
        if tuple(groups.get(g) for g in METHOD_GROUPS) == chosen:
            return str(preset.method)
    return derived_method(*chosen)


def what_trains(cfg: DictConfig) -> str:
    """The line a run prints as it starts: its method, the choices that make it (experiment, algorithm,
    divergence with its beta, guide), the model, the steps and the seed."""
    choices, _ = hydra_context()
    made = [f"{g}={choices[g]}" for g in ("experiment", *METHOD_GROUPS) if choices.get(g)]
    beta = OmegaConf.select(cfg, "divergence.beta", default=None)
    if beta is not None:
        made.append(f"beta={beta}")
    model = choices.get("model") or OmegaConf.select(cfg, "model.name", default="?")
    method = method_of(cfg, choices) or "run"
    steps = OmegaConf.select(cfg, "trl.max_steps", default="?")
    return f"training {method} ({', '.join(made)}) on model={model}: {steps} steps, seed {cfg.get('seed')}"


def derived_method(algorithm: str, divergence: str, guide: str) -> str:
    """A method no preset names, from its choices: ``dr_grpo+forward_kl+token`` (guide=none left out)."""
    return "+".join([algorithm, divergence] + ([guide] if guide != "none" else []))

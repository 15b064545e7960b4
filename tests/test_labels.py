"""Labels and figures a reader meets first (issue 40, item 6): single runs named and tagged by their method,
no "± 0.000" from one evaluation seed, a pass@k comparison whose every line stays visible, no empty panel,
no cut-off title."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from mlflow.tracking import MlflowClient
from omegaconf import open_dict

from analysis import figures, load
from sage.config import register_configs
from sage.eval.artifacts import passk_plot, passk_table
from sage.eval.evaluate import format_table
from sage.run_names import what_trains
from sage.tracking import start_run

matplotlib.use("Agg")
REPO = Path(__file__).resolve().parents[1]
register_configs()


@pytest.mark.parametrize(
    "overrides, method, name, label",
    [
        ([], "grpo", "grpo-s0", "GRPO"),
        (["guide=branch"], "grpo_branch", "grpo_branch-s0", "GRPO + Branch"),
        (["divergence=none", "seed=3"], "grpo_nokl", "grpo_nokl-s3", "GRPO w/o KL"),
        # no preset chooses these: the method is the choices, the report's label the one they always had
        (["divergence=forward_kl", "guide=token"], "grpo+forward_kl+token", "grpo+forward_kl+token-s0",
         "GRPO + forward KL + Token"),
        (["trl.max_steps=0"], "base", "base-s0", "base"),
    ],
)  # fmt: skip
def test_a_single_run_is_named_and_tagged_by_its_method(tmp_path, overrides, method, name, label):
    """Outside a grid every run was `grpo-s0` with no `method` tag, whatever guide or divergence it ran."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"tracking.uri={uri}"], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # as sage-train's Hydra app has it while the run starts
    try:
        with open_dict(cfg):
            del cfg["hydra"]
        with start_run(cfg, tmp_path, kind="train") as tracker:
            run_id = tracker.run_id
    finally:
        HydraConfig.instance().cfg = None
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.run_name == name and run.data.tags["method"] == method
    assert load.method_label(run.data.tags, run.data.params, run_id) == label


def test_a_run_says_what_it_trains():
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            "train", overrides=["guide=branch", "seed=2", "trl.max_steps=7"], return_hydra_config=True
        )
    HydraConfig.instance().set_config(cfg)
    try:
        line = what_trains(cfg)
    finally:
        HydraConfig.instance().cfg = None
    beta = cfg.divergence.beta
    assert line == (
        "training grpo_branch (algorithm=grpo, divergence=reverse_kl, guide=branch, "
        f"beta={beta}) on model=tiny: 7 steps, seed 2"
    )


def test_one_evaluation_seed_shows_the_mean_without_a_zero_std():
    summary = {"pass@1": 0.25, "pass@1_std": 0.0, "pass@4": 0.5, "pass@4_std": 0.0}
    one = format_table({"trained": {"arith_heldout": summary}}, [1, 4], seeds=1)
    assert one.splitlines()[-1] == "| trained | arith_heldout | 0.250 | 0.500 |" and "±" not in one
    two = format_table({"trained": {"arith_heldout": {**summary, "pass@1_std": 0.01}}}, [1, 4], seeds=2)
    assert two.splitlines()[-1] == "| trained | arith_heldout | 0.250 ± 0.010 | 0.500 ± 0.000 |"


def curves_of(rows: list[str]) -> pd.DataFrame:
    """Near-identical curves for each row (two seeds), as a grid of similar methods gives."""
    out = []
    for i, row in enumerate(rows):
        for seed in (1, 2):
            for k in (1, 2, 4, 8, 16):
                out.append((row, seed, "arith_heldout", k, 0.3 + 0.1 * np.log2(k) + 0.002 * i + 0.01 * seed))
    return pd.DataFrame(out, columns=["row", "seed", "dataset", "k", "value"])


def test_the_passk_comparison_gives_every_row_a_panel_where_its_line_is_in_front():
    """Five rows' translucent bands stacked in one panel hid GRPO's line: each row gets its own panel, its
    line in colour above its band, the other rows grey behind it."""
    rows = ["base", "GRPO", "GRPO w/o KL", "GRPO + Random", "GRPO + Branch"]
    fig = figures.passk_panels(curves_of(rows), "arith_heldout")
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in shown] == rows
    for ax, row in zip(shown, rows, strict=True):
        coloured = [ln for ln in ax.get_lines() if ln.get_color() != figures.OTHER_ROWS]
        assert [ln.get_label() for ln in coloured] == [row]
        grey = [ln for ln in ax.get_lines() if ln.get_color() == figures.OTHER_ROWS]
        assert len(grey) == len(rows) - 1
        assert all(c.get_alpha() < 1 and c.get_zorder() < coloured[0].get_zorder() for c in ax.collections)
    matplotlib.pyplot.close(fig)


def test_every_methods_reward_line_shows_when_their_curves_coincide(tmp_path):
    """Issue 47: four methods that train alike drew one line over the other and GRPO's vanished. The
    rendered figure holds pixels of each row's own colour (not its band's, which is paler)."""
    import numpy as np

    rows = ["GRPO", "GRPO w/o KL", "GRPO + Random", "GRPO + Branch"]
    reward = pd.DataFrame(
        [(r, s, step, 0.1 * step + 0.01 * s) for r in rows for s in (1, 2) for step in range(8)],
        columns=["row", "seed", "step", "value"],
    )  # the same curve and band for every row
    periodic = pd.DataFrame(columns=["row", "seed", "dataset", "step", "value"])
    image = matplotlib.image.imread(figures.reward_vs_accuracy(reward, periodic, set(), tmp_path))[..., :3]
    colours = matplotlib.pyplot.rcParams["axes.prop_cycle"].by_key()["color"][: len(rows)]
    for row, colour in zip(rows, colours, strict=True):
        rgb = np.array(matplotlib.colors.to_rgb(colour))
        shown = (np.abs(image - rgb).max(axis=-1) < 0.04).sum()
        assert shown > 200, f"{row}'s line ({colour}) shows in {shown} pixels"


def test_no_empty_heldout_panel_without_periodic_evaluations(tmp_path):
    reward = pd.DataFrame(
        [("GRPO", s, step, 0.1 * step) for s in (1, 2) for step in range(4)],
        columns=["row", "seed", "step", "value"],
    )
    periodic = pd.DataFrame(columns=["row", "seed", "dataset", "step", "value"])
    path = figures.reward_vs_accuracy(reward, periodic, set(), tmp_path)
    width = matplotlib.image.imread(path).shape[1]
    assert width == 5 * 120  # the reward panel alone (5 in at 120 dpi); an empty second panel doubled it


@pytest.mark.parametrize("seeds", [1, 3])
@pytest.mark.parametrize("dataset", ["arith_heldout", "minerva_math"])
def test_a_runs_passk_title_fits_its_figure(dataset, seeds):
    curves = {"base": [{1: 0.2, 2: 0.3, 4: 0.4}] * seeds, "trained": [{1: 0.3, 2: 0.4, 4: 0.45}] * seeds}
    fig = passk_plot(passk_table(curves), dataset)
    fig.canvas.draw()
    box = fig.axes[0].title.get_window_extent(fig.canvas.get_renderer())
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height
    assert dataset in fig.axes[0].get_title()
    assert len(fig.axes[0].collections) == (2 if seeds > 1 else 0)  # a band only over several seeds
    matplotlib.pyplot.close(fig)

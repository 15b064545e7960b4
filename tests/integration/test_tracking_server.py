"""sage-train against a real `mlflow server` on localhost: params, tags, per-step metrics, eval curves and
artifacts go through the server's REST API, a resume continues the same run, and no secret is logged."""

import json
import os
import sys

import prefork
import pytest

pytestmark = pytest.mark.integration

SHRINK = [
    "trl.per_device_train_batch_size=16",
    "trl.num_generations=4",
    "trl.save_steps=1",
    "eval.n_samples=4",
    "eval.ks=[1,4]",
    "eval.limit=4",
]


def sage_train(uri, *overrides):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)  # the URI comes from the config here
    r = prefork.run(
        [sys.executable, "-m", "sage.train", *SHRINK, f"tracking.uri={uri}", *overrides],
        timeout=900,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-6000:]
    return r


def test_run_logged_to_server_and_resumed(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    secret = "postgresql://optuna:hunter2@db.example:5432/optuna"
    common = [f"output_dir={out}", "tracking.experiment=server-test", f"+tracking.tags.storage={secret}"]
    sage_train(mlflow_server, "trl.max_steps=1", "divergence=forward_kl", *common)
    sage_train(mlflow_server, "trl.max_steps=2", "divergence=forward_kl", "resume=true", *common)

    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("server-test")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1  # the resume did not create a second run
    run = client.get_run(runs[0].info.run_id)
    assert run.info.run_id == (out / "mlflow_run_id").read_text()
    assert run.info.status == "FINISHED"
    assert run.data.tags["divergence"] == "forward_kl"
    assert run.data.tags["storage"] == "postgresql://***@db.example:5432/optuna"
    everything = json.dumps([run.data.params, run.data.tags])
    assert "hunter2" not in everything
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2]
    metrics = json.loads((out / "metrics.json").read_text())
    assert run.data.metrics["pass_at_4/trained/arith_heldout"] == pytest.approx(
        metrics["pass_at_4/trained/arith_heldout"]
    )
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "metrics.json", "eval"} <= names

"""The tests' forked entry points (tests/prefork.py) behave as a fresh ``python -m`` would: same output and
exit code, the environment and working directory of the call, and a fresh interpreter whenever a variable
read at import time differs from the server's."""

import os
import sys

import prefork


def test_a_forked_run_prints_and_exits_as_a_fresh_one(tmp_path):
    argv = [sys.executable, "-m", "sage.train", "--cfg", "job", "trl.max_steps=3", "seed=7"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    forked = prefork.run(argv, env=env, cwd=tmp_path, timeout=300)
    os.environ["SAGE_TEST_PREFORK"] = "0"
    try:
        fresh = prefork.run(argv, env=env, cwd=tmp_path, timeout=300)
    finally:
        del os.environ["SAGE_TEST_PREFORK"]
    assert forked.returncode == fresh.returncode == 0, forked.stderr[-2000:]
    assert forked.stdout == fresh.stdout and "max_steps: 3" in forked.stdout and "seed: 7" in forked.stdout

    typo = [sys.executable, "-m", "sage.train", "trl.max_steps=many", f"output_dir={tmp_path / 'out'}"]
    bad = prefork.run(typo, env=env, timeout=300)
    assert bad.returncode == 1 and "trl.max_steps" in bad.stderr  # Hydra's own error and exit status


def test_the_call_s_environment_and_folder_reach_the_run(tmp_path):
    """A relative ``output_dir`` of sage-train lands in the call's cwd, and a variable read at run time (the
    MLflow URI) is the call's."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_TRACKING_URI": uri}
    argv = [sys.executable, "-m", "sage.train", "trl.max_steps=0", "eval.at_end=false", "output_dir=rel"]
    r = prefork.run(argv, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "rel" / "config.yaml").is_file()
    assert (tmp_path / "store.db").is_file()  # the run logged to the call's store


def test_an_import_time_variable_with_another_value_gets_a_fresh_interpreter():
    server = prefork._get_server()
    env = prefork.call_env({**os.environ, "HF_HUB_OFFLINE": "1"})
    assert server.differs(env) == []
    assert server.differs({k: v for k, v in env.items() if k != "HF_HUB_OFFLINE"}) == ["HF_HUB_OFFLINE"]
    assert server.differs({**env, "OMP_NUM_THREADS": "7"}) == ["OMP_NUM_THREADS"]
    assert server.differs({**env, "PYTHONPATH": "/elsewhere"}) == ["PYTHONPATH"]
    assert server.differs({**env, "MLFLOW_TRACKING_URI": "sqlite:///x.db", "SAGE_CACHE_DIR": "/c"}) == []


def test_what_the_session_s_own_process_left_in_its_environment_is_not_the_call_s(monkeypatch):
    """A variable an earlier in-process test or import set (vLLM sets VLLM_* and more) is not passed on;
    one the call sets is."""
    monkeypatch.setenv("VLLM_LEFT_BEHIND", "1")
    env = prefork.call_env({**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "7"})
    assert "VLLM_LEFT_BEHIND" not in env and env["OMP_NUM_THREADS"] == "7" and env["HF_HUB_OFFLINE"] == "1"

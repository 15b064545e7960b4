"""Session-wide isolation: every run of the test session logs to a throwaway MLflow store, never to the
repository's embedded store (subprocesses inherit the variable)."""

import os
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # `make test`'s workers share the machine's cores: each worker, and every process its tests start, gets
    # its share of them. Without it each process runs a thread per core, and OpenMP threads that spin at
    # barriers while the other worker holds the cores slow every test.
    _share = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, _share)


@pytest.fixture(scope="session", autouse=True)
def _private_mlflow_store(tmp_path_factory):
    if os.environ.get("MLFLOW_TRACKING_URI"):
        yield
        return
    root = tmp_path_factory.mktemp("mlflow")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'mlflow.db'}"
    yield
    del os.environ["MLFLOW_TRACKING_URI"]


@pytest.fixture(scope="session")
def testbed_model() -> Path:
    """The testbed model's folder (built once per machine, then read from its cache): tests copy it to
    damage or change it, never write into it."""
    from sage.testbed.model import build_tiny_model

    return Path(build_tiny_model())


@pytest.fixture(scope="session")
def small_testbed_model(tmp_path_factory) -> str:
    """A testbed model shrunk to one narrow layer and 3 training steps, in a cache of its own: the trainer
    tests' model, where what is tested is the loss and the logging, not what the model learnt."""
    from sage.testbed.model import build_tiny_model

    return build_tiny_model(
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        train_steps=3,
        n_train_problems=64,
        cache_dir=str(tmp_path_factory.mktemp("small_model_cache")),
    )


@pytest.fixture
def checkpoint(tmp_path: Path) -> str:
    """A folder with the testbed tokenizer: all the evaluator reads before it needs a sampler."""
    from sage.testbed.tokenizer import build_tokenizer

    folder = tmp_path / "ckpt"
    build_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture
def sampler(monkeypatch):
    """The evaluator's sampler and grading pool replaced by ``evaluator_fakes``' (a known matrix of samples,
    graded in-process); counts how often a sampler was opened."""
    from evaluator_fakes import FakePool, FakeSampler

    import sage.eval.evaluate as ev

    fake = FakeSampler()

    def open_sampler(*args, **kwargs):
        fake.opened += 1
        return fake

    monkeypatch.setattr(ev, "open_sampler", open_sampler)
    monkeypatch.setattr(ev, "GradingPool", lambda workers: FakePool())
    return fake


# tryfirst: xdist reads the mark in its own collection hook, which must see it
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """`make test` runs the suite on pytest-xdist workers (--dist loadgroup). The integration tests share one
    SLURM cluster, whose session fixture starts and stops it: two workers would each start (and stop) it under
    the other's jobs. So every integration test goes to one worker, in file order, and every other vLLM test
    to one worker; the rest are spread, but the tests that share a module-scoped fixture stay together."""
    for item in items:
        if item.get_closest_marker("integration"):
            item.add_marker(pytest.mark.xdist_group("services"))
        elif item.get_closest_marker("vllm"):
            # a vLLM engine on a CPU reserves its KV cache up front (eval.vllm_cpu_memory_utilization of the
            # machine's memory) and refuses to start when that much is not free: one engine at a time
            item.add_marker(pytest.mark.xdist_group("vllm"))
        elif _uses_module_fixture(item):
            # a module-scoped fixture (real training runs, a built model) is built once per worker that runs
            # one of its tests: split over two workers, it is built twice
            item.add_marker(pytest.mark.xdist_group(f"module:{item.nodeid.split('::')[0]}"))


def _uses_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values())

"""sage-train imports TRL's GRPOTrainer without vLLM unless the run samples through vLLM
(`sage.train.trl_import`), and a process that needs vLLM afterwards still gets TRL's vLLM path whole."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

# A fresh interpreter: this test process may have imported TRL (and vLLM) already.
TRAIN_THEN_NEED_VLLM = r"""
import json, sys
sys.argv = ["sage-train", "trl.max_steps=1", "trl.per_device_train_batch_size=8", "trl.num_generations=4",
            "eval.n_samples=2", "eval.ks=[1]", "eval.limit=2", "output_dir=" + sys.argv[1]]
from sage.train.main import main
try:
    main()
except SystemExit as e:
    assert not e.code, e.code
after_run = "vllm" in sys.modules
from trl.import_utils import is_vllm_available
truth_after = is_vllm_available()
from sage.train.trl_import import import_grpo_trainer
import_grpo_trainer(use_vllm=True)
import vllm
import trl.generation.vllm_generation as gen
import trl.generation.vllm_client as client
print(json.dumps({"vllm_after_run": after_run, "truth_after": truth_after,
                  "llm_is_vllms": getattr(gen, "LLM", None) is vllm.LLM,
                  "exported": "VLLMGeneration" in sys.modules["trl.generation"].__all__,
                  "client_flag": client._HAS_STATEFUL_TRAINER_ENGINE}))
"""


def test_a_run_without_vllm_never_imports_it_and_a_later_vllm_run_gets_trls_vllm_path(tmp_path):
    pytest.importorskip("vllm")
    r = subprocess.run(
        [sys.executable, "-c", TRAIN_THEN_NEED_VLLM, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/m.db"},
    )
    assert r.returncode == 0, r.stderr[-4000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["vllm_after_run"] is False  # a whole run (train and evaluate) with rollout=fast
    assert seen["truth_after"] is True  # TRL's own check answers truthfully once the import is done
    assert seen["llm_is_vllms"] is True  # after the reload, TRL's generation module holds vLLM's names
    assert seen["exported"] is True
    import vllm
    from packaging.version import Version

    assert seen["client_flag"] is (Version(Version(vllm.__version__).base_version) >= Version("0.28.0"))


def _guards_vllm_imports(path: Path) -> bool:
    """Whether a module's top level has ``if is_vllm_available(...)`` around an import."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if not isinstance(node, ast.If):
            continue
        calls = [n for n in ast.walk(node.test) if isinstance(n, ast.Call)]
        if any(getattr(c.func, "id", getattr(c.func, "attr", None)) == "is_vllm_available" for c in calls):
            if any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(node)):
                return True
    return False


def test_every_trl_module_the_trainer_loads_whose_top_level_asks_for_vllm_is_reloaded():
    """The list of modules to reload is complete for the installed TRL: every module that the GRPO trainer's
    import loads and whose top level imports vLLM conditionally."""
    code = (
        "import json, sys; from sage.train.trl_import import import_grpo_trainer; "
        "import_grpo_trainer(False); "
        "print(json.dumps({n: getattr(m, '__file__', None) for n, m in sys.modules.items() "
        "if n.startswith('trl') and m is not None}))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    loaded = json.loads(r.stdout.strip().splitlines()[-1])
    guarded = {n for n, f in loaded.items() if f and f.endswith(".py") and _guards_vllm_imports(Path(f))}
    from sage.train.trl_import import CONDITIONAL

    assert guarded, "the check found no guarded module: TRL's layout changed, update the check"
    assert guarded <= set(CONDITIONAL), guarded - set(CONDITIONAL)

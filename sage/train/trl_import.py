"""Import TRL's GRPOTrainer without vLLM when the run does not sample through vLLM.

Why: ``trl.generation`` (imported by ``trl.trainer.grpo_trainer``) imports vLLM at module level whenever
the package is installed, whatever ``use_vllm`` says. vLLM's import is a large share of a training
process's start-up, and every sage-train process, every grid job and every test run pays it, even with
``rollout=fast`` or ``rollout=hf`` where vLLM is never called.

How: TRL's modules ask ``trl.import_utils.is_vllm_available`` at import time. During the import only, that
function answers False; afterwards it delegates to TRL's own check again, so later calls (and TRL's own
``use_vllm`` validation) see the truth. A process that imported the trainer without vLLM and then needs it
(``use_vllm=True``) reloads the modules whose top level depends on the answer: the trainer itself holds only
the class ``VLLMGeneration``, whose methods look their vLLM names up in those modules at call time.
"""

from __future__ import annotations

import importlib
import sys

# The modules of trl whose top level runs ``if is_vllm_available(...)`` around imports of vllm. A test
# checks that the list is complete for the installed TRL.
CONDITIONAL = ("trl.generation.vllm_client", "trl.generation.vllm_generation", "trl.generation")

_state = {"imported_without_vllm": False}


def import_grpo_trainer(use_vllm: bool):
    """Import ``trl.GRPOTrainer`` (vLLM's modules only if ``use_vllm``) and return the class."""
    if not use_vllm and "trl.trainer.grpo_trainer" not in sys.modules:
        import trl.import_utils as import_utils

        real = import_utils.is_vllm_available
        hiding = [True]

        def is_vllm_available(min_version: str | None = None) -> bool:
            return False if hiding[0] else real(min_version)

        import_utils.is_vllm_available = is_vllm_available
        try:
            importlib.import_module("trl.trainer.grpo_trainer")
        finally:
            hiding[0] = False
        _state["imported_without_vllm"] = True
    elif use_vllm and _state["imported_without_vllm"]:
        for name in CONDITIONAL:
            if name in sys.modules:
                importlib.reload(sys.modules[name])
        _state["imported_without_vllm"] = False
    from trl import GRPOTrainer

    return GRPOTrainer

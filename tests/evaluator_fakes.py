"""The evaluator without a model (imported as ``evaluator_fakes``; its fixtures ``checkpoint`` and ``sampler``
are in conftest.py): a sampler whose samples are a known, seed-dependent matrix, an in-process grading pool,
the rows they answer, and ``run``, an evaluation of those rows as the trainer and sage-eval call it."""

from __future__ import annotations

from types import SimpleNamespace

import sage.eval.evaluate as ev
import sage.eval.sampling as sampling
from sage.data.verifiers import grade
from sage.eval.evaluate import evaluate_model
from sage.eval.sampling import Samples

ROWS = {
    "a": [{"id": f"a{i}", "problem": f"{i}+1=", "answer": str(i + 1)} for i in range(3)],
    "b": [{"id": f"b{i}", "problem": f"{i}*2=", "answer": str(2 * i)} for i in range(2)],
}


def eval_cfg(**changes):
    base = {
        "n_samples": 4,
        "ks": [1, 4],
        "seeds": [0, 1],
        "temperature": 1.0,
        "top_p": 1.0,
        "batch_size": 8,
        "backend": "hf",
    }
    return SimpleNamespace(**{**base, **changes})


CELL_SEED_OF = {ev.block_seed(seed, 0): seed for seed in range(10)}
"""The cells here are one block each (at most 3 problems x 4 samples): block 0's seed -> the cell's seed."""


class FakeSampler:
    """Sample j of row i is right when (i + j + seed) % 3 == 0: a known, seed-dependent matrix (``seed``:
    the cell's)."""

    def __init__(self):
        self.calls: list[int] = []  # the cell seed of every block sampled
        self.fail_on_call: int | None = None
        self.opened = 0  # how many times a sampler (a model) was loaded
        self.closed = 0  # ... and shut down

    def sample_blocks(self, blocks, settings, progress=None):
        return [self.sample(ids, s, progress) for ids, s in zip(blocks, settings, strict=True)]

    def sample(self, prompt_ids, s, progress=None):
        s = sampling.SamplingSettings(**{**s.__dict__, "seed": CELL_SEED_OF[s.seed]})
        self.calls.append(s.seed)
        if self.fail_on_call is not None and len(self.calls) == self.fail_on_call:
            raise KeyboardInterrupt  # the evaluation is killed here
        for _ in prompt_ids:  # one problem at a time, as a sampler's batches finish
            if progress is not None:
                progress(s.n_samples)
        out = [
            [
                f"<SOLUTION>{'RIGHT' if (i + j + s.seed) % 3 == 0 else 'wrong'}</SOLUTION>"
                for j in range(s.n_samples)
            ]
            for i in range(len(prompt_ids))
        ]
        return Samples(out, n_tokens=0)

    def close(self):
        self.closed += 1


class FakePool:
    """In-process grading; RIGHT stands for the gold answer."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    verifiers_seen: list[str] = []

    def grade_many(self, completions, golds, verifiers):
        FakePool.verifiers_seen.extend(verifiers)
        return [
            grade(c.replace("RIGHT", g), g, verifier=v)
            for c, g, v in zip(completions, golds, verifiers, strict=True)
        ]


def run(checkpoint, results_dir, cfg=None, rows=ROWS, **kw):
    return evaluate_model(
        checkpoint,
        rows,
        cfg or eval_cfg(),
        chat=False,
        max_new_tokens=kw.pop("max_new_tokens", 16),
        results_dir=results_dir,
        dtype=kw.pop("dtype", "float32"),
    )

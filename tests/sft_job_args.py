"""The overrides the SFT-job tests share (tests/test_sft_jobs.py locally and
tests/integration/test_slurm_sft_job.py on SLURM): the SFT stage and the RL jobs at their smallest, since
what they check is the order and who builds what, not what the models say."""

SMALL_SFT = [
    "model=tiny_chat",
    "model.source.train_steps=20",  # a base model of its own, quick to build
    "model.sft.data.n=16",
    "model.sft.args.num_train_epochs=1",
]
QUICK_RL = [
    "trl.max_steps=1",
    "trl.per_device_train_batch_size=4",
    "trl.num_generations=2",
    "eval.at_end=false",
    "tracking.enabled=false",
]


def new_stage() -> str:
    """An SFT seed no earlier run has used, so that the stage is not in the model cache (a process id would
    repeat across test sessions on one machine, and the cache outlives them)."""
    import secrets

    return f"model.sft.args.seed={secrets.randbelow(2**31)}"

"""Training: the TRL subclass (``trainer``), the SFT stage (``sft``), callbacks, the entry point (``main``).

Nothing is imported here, so ``import sage.train.trainer`` does not run the entry point's module.
"""

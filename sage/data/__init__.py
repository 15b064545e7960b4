"""What the models read and how it is judged: prompt templates, RL/SFT datasets, benchmarks, verifiers.

Nothing is imported here, so the pure-python modules stay free of ``datasets`` and torch.
"""

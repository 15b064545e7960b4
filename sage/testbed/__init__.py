"""Embedded testbed: a verifiable arithmetic world (``task``, which re-exports it from sage.data.arith, where
data and analysis take it from) and a tiny Qwen2 trained on it (``model``).

Nothing is re-exported here so that importing the pure-python ``task`` module never pulls in torch.
"""

"""Evaluation: samplers and their decode loop, stored result cells, the ``sage-eval`` entry point (``main``).

Nothing is imported here, so the maths and the cells can be used without loading torch's decoders.
"""

"""The objective's maths as pure functions and small classes: divergences, guides, schedules, aggregation.

Nothing here knows TRL, Hydra or a model; ``sage.train.trainer`` wires these into TRL's loss.
"""

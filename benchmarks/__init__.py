"""Development benchmarks (`make bench`): not part of the installed package; run from a clone."""

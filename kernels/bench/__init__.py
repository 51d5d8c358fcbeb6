"""Measurements: timing (CUDA graphs, rotated inputs), one module per op's GPU measurements and
CPU checks, and the registry of parts that the validation command runs (:mod:`.parts`)."""

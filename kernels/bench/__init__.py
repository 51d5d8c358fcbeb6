"""GPU measurements: timing (CUDA graphs, rotated inputs), one module per op's benchmark, and
the registry of parts that the validation command runs (:mod:`.parts`)."""

"""vLLM: the check that asks whether a vLLM deployment is batch-invariant, per mode."""

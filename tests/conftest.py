import batch_invariance_kit  # noqa: F401  (device selection before triton is imported)
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run on a GPU box (these are not counted as passes on CPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

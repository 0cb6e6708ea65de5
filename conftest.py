"""Workspace-wide pytest hooks: `gpu` tests skip cleanly on machines without CUDA."""

import os

import pytest

# The CuTe DSL reads its target when cutlass is first imported; a test module that imports it
# before the compile tests set it would leave the disk-cache export of the kernels unable to
# work without a GPU. The kernels target sm_90a only.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)

"""Workspace-wide pytest hooks: `gpu` tests skip cleanly on machines without CUDA, `sm90` tests\nwithout a Hopper GPU."""

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
    sm90_items = [item for item in items if "sm90" in item.keywords]
    if sm90_items:
        from ffa_kernels.testing import is_sm90

        if not is_sm90():
            skip_sm90 = pytest.mark.skip(reason="needs an sm90 GPU")
            for item in sm90_items:
                item.add_marker(skip_sm90)
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)

"""Suite-wide settings: one torch thread (CI has 2 cores), gpu tests skipped without CUDA."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _cuda_available() -> bool:
    # Without an NVIDIA device node there is no CUDA: skip importing torch (seconds per pytest run).
    if not os.path.exists("/dev/nvidiactl"):
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Triton reads TRITON_INTERPRET when a kernel is decorated, so it must be set before any module that
# defines a kernel is imported: without a GPU the kernels run in the interpreter (small shapes only).
if "TRITON_INTERPRET" not in os.environ and not _cuda_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> None:
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


# One embedded `kumo serve` for the whole session, shared by every test that asks for `kumo`
# (a fixture imported into several test modules would start one server per module).
from tests.e2e.serve_process import close_sdk_clients, kumo  # noqa: E402, F401

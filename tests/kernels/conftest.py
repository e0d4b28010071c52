"""Fixtures the C kernels' tests share."""

from __future__ import annotations

import pytest

from shoal.kernels import cpu_build, ops
from tests.kernels import on_device


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """An empty kernel cache and no library loaded yet in this process."""
    monkeypatch.setenv("SHOAL_KERNEL_CACHE_DIR", str(tmp_path / "kernels"))
    cpu_build.load_kernel_library.cache_clear()
    yield tmp_path / "kernels"
    cpu_build.load_kernel_library.cache_clear()


@pytest.fixture(autouse=True)
def triton_on_device(request, monkeypatch):  # type: ignore[no-untyped-def]
    """With ``SHOAL_TEST_DEVICE`` set, the Triton tests' kernels run on that GPU
    (``tests.kernels.on_device``); otherwise nothing changes."""
    device = on_device.device_under_test()
    if device is not None:
        on_device.patch_triton_entry_points(monkeypatch, [request.module, ops], device)
    yield

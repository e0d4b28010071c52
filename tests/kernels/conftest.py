"""Fixtures the C kernels' tests share."""

from __future__ import annotations

import pytest

from shoal.kernels import cpu_build


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """An empty kernel cache and no library loaded yet in this process."""
    monkeypatch.setenv("SHOAL_KERNEL_CACHE_DIR", str(tmp_path / "kernels"))
    cpu_build.load_kernel_library.cache_clear()
    yield tmp_path / "kernels"
    cpu_build.load_kernel_library.cache_clear()

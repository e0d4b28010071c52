"""Test-wide settings: one torch thread per process, Triton in interpreter mode (set before any
kernel module is imported), ``--dtype auto`` as fp32 on every machine, and the shared fixtures
from ``tests/fixtures``."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# --dtype auto would be bf16 on CPUs with bf16 units: the suite's references are fp32 (tests of
# bf16 ask for it by name), so every machine runs the same tests
os.environ.setdefault("SHOAL_AUTO_DTYPE", "float32")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The C kernels are built once for the whole suite (tens of seconds each time), also by the
# tests and the processes they start that point SHOAL_CACHE_DIR elsewhere for their other files;
# the tests of the build itself point SHOAL_KERNEL_CACHE_DIR at an empty folder.
_default_cache = os.environ.get("SHOAL_CACHE_DIR") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "shoal"
)
os.environ.setdefault("SHOAL_KERNEL_CACHE_DIR", os.path.join(_default_cache, "kernels"))

pytest_plugins: list[str] = ["tests.fixtures.models", "tests.fixtures.nats"]

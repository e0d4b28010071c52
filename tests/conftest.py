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

pytest_plugins: list[str] = ["tests.fixtures.models", "tests.fixtures.nats"]

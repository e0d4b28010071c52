"""The one compiled part of shoal's engine core: the block pool's arrays
(``engine/core/native_block_pool.c``). Optional: where it does not build (no C compiler), the
Python arrays (``engine/core/block_pool_arrays.py``) run instead. Everything else is in
pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shoal.engine.core._native_block_pool",
            sources=["engine/core/native_block_pool.c"],
            extra_compile_args=["-O2", "-std=c11"],
            optional=True,
        )
    ]
)

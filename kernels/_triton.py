"""Optional Triton import: the torch references must work where Triton is not installed.

When Triton is missing, ``triton.jit`` is a no-op decorator and ``tl.constexpr`` a placeholder, so
the kernel modules still import; their Triton wrappers then refuse to run.
"""

from typing import Any

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False

    class _StubTriton:
        @staticmethod
        def jit(fn: Any = None, **_: Any) -> Any:
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, (n - 1).bit_length())

    class _StubLanguage:
        constexpr = object

    triton = _StubTriton()  # type: ignore[assignment]
    tl = _StubLanguage()  # type: ignore[assignment]


def require_triton() -> None:
    """Raise a clear error when a Triton kernel is requested without Triton installed."""
    if not HAS_TRITON:
        raise RuntimeError(
            "Triton is not installed: install shoal[triton] or set SHOAL_KERNELS=torch"
        )

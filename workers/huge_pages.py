"""Transparent huge pages for a CPU worker's big buffers: the weights, their oneDNN-packed copies
and the KV cache.

A decode step reads every weight and a scattered set of KV pages; with 4 KiB pages each 2 MiB of
them costs 512 TLB entries, with huge pages one. torch's CPU allocator asks the kernel for huge
pages (``madvise(MADV_HUGEPAGE)``) on allocations of 2 MiB or more when ``THP_MEM_ALLOC_ENABLE``
is 1, reading the variable once, at the process's first such allocation: so the worker sets it
before its weights load (``enable_huge_pages``), and a process that allocated large tensors
earlier keeps 4 KiB pages. Set ``THP_MEM_ALLOC_ENABLE=0`` to keep them anyway. Where the kernel's
THP mode is ``never`` the advice is ignored.
"""

from __future__ import annotations

import os

ENV_VAR = "THP_MEM_ALLOC_ENABLE"


def enable_huge_pages() -> bool:
    """Ask torch's CPU allocator for huge pages unless the environment already decided;
    whether they are asked for."""
    return os.environ.setdefault(ENV_VAR, "1") == "1"

"""The engine core's shell and links talk to ``EngineCore`` only (issue 32): no module under
``engine/actor/`` reaches into the core's scheduler or what the scheduler owns (its KV cache
manager, block pool, offload connector, speculative decoding), nor imports those modules. Read
from the source with ``ast``, so a new side door fails here with its file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELL = ROOT / "engine" / "actor"
BEHIND_THE_DOOR = {"scheduler", "kv_cache_manager", "block_pool", "connector", "spec"}
PRIVATE_MODULES = {
    "shoal.engine.core.scheduler",
    "shoal.engine.core.kv_cache_manager",
    "shoal.engine.core.block_pool",
    "shoal.engine.core.offload_connector",
    "shoal.engine.core.spec_decoding",
}


def side_doors(source: str, path: str) -> list[str]:
    """Every attribute read of a member behind the door and every import of a module there."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in BEHIND_THE_DOOR:
            found.append(f"{path}:{node.lineno} reads .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module in PRIVATE_MODULES:
            found.append(f"{path}:{node.lineno} imports {node.module}")
        elif isinstance(node, ast.Import):
            found += [
                f"{path}:{node.lineno} imports {alias.name}"
                for alias in node.names
                if alias.name in PRIVATE_MODULES
            ]
    return found


def test_the_shell_uses_the_front_door_only() -> None:
    found = [
        door
        for path in sorted(SHELL.glob("*.py"))
        for door in side_doors(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not found, "the engine core's shell reaches past EngineCore:\n" + "\n".join(found)


def test_a_side_door_is_caught() -> None:
    source = (
        "from shoal.engine.core.scheduler import Scheduler\n"
        "def f(core):\n"
        "    return core.scheduler.kv_cache_manager\n"
    )
    assert side_doors(source, "x.py") == [
        "x.py:1 imports shoal.engine.core.scheduler",
        "x.py:3 reads .kv_cache_manager",
        "x.py:3 reads .scheduler",
    ]

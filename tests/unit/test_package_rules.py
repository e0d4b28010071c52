"""The floor plan's import rules, read from the source with ``ast`` (every import statement,
including the lazy ones inside functions and under ``TYPE_CHECKING``).

Imports run one way: deploy → gateway → engine client → bus; engine actor → engine core → bus
messages; recovery controller → bus (its policy: bus messages only); workers → kernels and bus;
tiers → bus. A new violation fails here with the file, the line and the rule it breaks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = (
    "config",
    "bus",
    "kv_events",
    "engine",
    "workers",
    "kernels",
    "tiers",
    "gateway",
    "deploy",
    "tracing",
)
TORCH = ("torch", "triton", "numpy")
IO = ("asyncio", "nats", "aiohttp", "socket", "subprocess", "threading", "anyio")


@dataclass(frozen=True)
class Rule:
    """Modules under ``package`` may import these shoal packages only (longest package wins).
    ``runs``: what runs there, for the floor plan's table in docs/architecture.md."""

    package: str
    allowed: tuple[str, ...]
    forbidden_third_party: tuple[str, ...] = ()
    why: str = ""
    runs: str = ""


RULES = (
    Rule(
        "shoal.config",
        ("shoal.config",),
        TORCH + IO,
        "the configuration is a leaf: msgspec only",
        "every process: the deployment's configuration (`ShoalConfig` and its groups)",
    ),
    Rule(
        "shoal.bus",
        ("shoal.bus", "shoal.config"),
        why="the bus knows no engine, model or GPU",
        runs="every process: the `Bus` interface, subjects, codecs and wire schemas; the "
        "transports (`transport/`), JetStream (`jetstream/`), the actor runtime (`runtime/`: "
        "actors, liveness, processes, the supervisor), NATS operations (`nats_ops/`)",
    ),
    Rule(
        "shoal.kv_events",
        ("shoal.kv_events", "shoal.bus", "shoal.config"),
        TORCH,
        "prefix routing's KV events ride the bus but are not the bus's: no engine, no tier",
        "engine core actors, KV tiers and engine clients: the KV-events publisher a source "
        "sends its batches through, and the stream that keeps them",
    ),
    Rule(
        "shoal.bus.messages",
        ("shoal.bus.messages",),
        TORCH + IO,
        "wire schemas are a leaf: msgspec only",
        "the wire schemas, one module per boundary",
    ),
    Rule(
        "shoal.tracing",
        ("shoal.tracing", "shoal.config"),
        TORCH,
        "tracing wraps OpenTelemetry for the actors: it knows no actor, engine or transport",
        "every actor that traces: the W3C context as carried, the tracer and its exporter "
        "(OpenTelemetry imported only with --otlp-traces-endpoint)",
    ),
    Rule(
        "shoal.kernels",
        ("shoal.kernels",),
        why="kernels import torch and triton only",
        runs="inside the workers: Triton kernels, their torch references, the CPU's C kernels",
    ),
    Rule(
        "shoal.workers",
        ("shoal.workers", "shoal.kernels", "shoal.bus", "shoal.config", "shoal.tracing"),
        runs="worker processes: model runner, models, layers, sampler, CUDA graphs, speculative "
        "decoding's proposers, the worker actor",
    ),
    Rule(
        "shoal.tiers",
        ("shoal.tiers", "shoal.kv_events", "shoal.bus", "shoal.config"),
        runs="KV offload's tier actors: the CPU tier (`cpu/`), the filesystem and object-store "
        "tiers (`secondary/`), the peer-to-peer tier (`p2p/`)",
    ),
    Rule(
        "shoal.tiers.books",
        ("shoal.tiers.books", "shoal.bus.messages", "shoal.config"),
        TORCH + IO,
        "the offload books are pure: no I/O, no torch, no transport",
        "KV offload's pure books: keys, the offload manager and its eviction policies, store "
        "filters, leases, backpressure, the p2p sessions (the engine core imports them)",
    ),
    Rule(
        "shoal.engine.core",
        ("shoal.engine.core", "shoal.bus.messages", "shoal.config", "shoal.tiers.books"),
        TORCH + IO,
        "the engine core is pure: no I/O, no torch, no transport, no client or shell "
        "(the offload books of tiers/ are pure too)",
        "inside the engine core actor: the pure core (requests, scheduler, step outcome, steps in "
        "flight, KV cache manager, block pool and its free queue, block hashes, stop checks, "
        "the KV offload connector, speculative decoding's K, `EngineCore`)",
    ),
    Rule(
        "shoal.engine.structured",
        ("shoal.engine.structured", "shoal.engine.core", "shoal.bus.messages", "shoal.config"),
        tuple(m for m in IO if m != "threading"),  # it compiles on a thread of its own
        "the grammar engine (xgrammar) behind the engine core's GrammarBackend: no transport",
        "inside the engine core actor (and the client's grammar check): structured outputs' "
        "grammar engine",
    ),
    Rule(
        "shoal.engine.actor",
        (
            "shoal.engine.actor",
            "shoal.engine.core",
            "shoal.engine.structured",
            "shoal.kv_events",
            "shoal.bus",
            "shoal.config",
            "shoal.tracing",
        ),
        TORCH,
        "the engine core's shell meets workers and clients through messages only",
        "the engine core actor's shell (`core_actor.py`) and its links: to the workers, its KV "
        "tier, the other engine cores (lock-step), KV events",
    ),
    Rule(
        "shoal.engine.client",
        (
            "shoal.engine.client",
            "shoal.kv_events",
            "shoal.bus",
            "shoal.config",
            "shoal.engine.core.block_hash",
            "shoal.engine.structured.grammars",
            "shoal.tracing",
        ),
        TORCH,
        "the client runs in the gateway's process: it talks to engine cores over the bus "
        "(and hashes prompts as they do, for prefix routing: block_hash is pure; it checks "
        "a request's grammar as engine cores build it)",
        "the gateway's or `LLM`'s process: `AsyncEngineClient`, output processor, detokenizer, "
        "stop strings, router and prefix index, resumption, user-facing outputs",
    ),
    Rule(
        "shoal.engine.recovery",
        ("shoal.engine.recovery", "shoal.bus", "shoal.config"),
        TORCH,
        "the recovery controller commands engine cores by message only",
        "the recovery controller actor",
    ),
    Rule(
        "shoal.engine.recovery.policy",
        ("shoal.bus.messages", "shoal.config"),
        TORCH + IO,
        "the recovery policy is pure: no I/O, no transport",
        "the recovery controller's pure policy",
    ),
    Rule(
        "shoal.gateway",
        ("shoal.gateway", "shoal.engine.client", "shoal.bus", "shoal.config", "shoal.tracing"),
        TORCH,
        "the gateway sees the engine through the client only",
        "the gateway: HTTP and NATS APIs, metrics",
    ),
    Rule(
        "shoal.deploy",
        ("shoal",),
        why="the composition root may start anything",
        runs="the launcher: the `shoal` command line, the offline `LLM`, the deployment plan, "
        "local mode",
    ),
)
TABLE_START = "<!-- the floor plan's rules: written by python -m tests.unit.test_package_rules -->"
TABLE_END = "<!-- end of the rules -->"


def rules_table() -> str:
    """The floor plan's table (docs/architecture.md), written from ``RULES``."""
    lines = [
        "| package | what runs there | may import of shoal | may not import |",
        "|---|---|---|---|",
    ]
    for rule in RULES:
        others = [p.removeprefix("shoal.") for p in rule.allowed if p != rule.package]
        allowed = "anything" if rule.allowed == ("shoal",) else ", ".join(f"`{p}`" for p in others)
        forbidden = ", ".join(rule.forbidden_third_party)
        lines.append(
            f"| `{rule.package}` | {rule.runs} | {allowed or 'nothing else'} | {forbidden} |"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    imported: str
    rule: Rule

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.imported} ({self.rule.why or 'not allowed'})"


def module_name(path: Path) -> str:
    """``engine/core/scheduler.py`` → ``shoal.engine.core.scheduler``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["shoal", *parts])


def imported_modules(source: str, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join([*parent, base]) if base else ".".join(parent)
            if base == "shoal":  # ``from shoal import bus`` names subpackages
                for alias in node.names:
                    yield node.lineno, f"shoal.{alias.name}"
            else:
                yield node.lineno, base


def rule_for(module: str) -> Rule | None:
    matching = [r for r in RULES if module == r.package or module.startswith(r.package + ".")]
    return max(matching, key=lambda r: len(r.package), default=None)


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def check_source(source: str, module: str, path: str, is_package: bool = False) -> list[Violation]:
    """The rule violations of one module's source."""
    rule = rule_for(module)
    found = []
    for line, name in imported_modules(source, module, is_package):
        root = name.split(".")[0]
        if root in FOLDERS:
            found.append(Violation(path, line, name, Rule("*", (), why="import it as shoal.*")))
        elif rule is None:
            continue
        elif root in rule.forbidden_third_party or (
            root == "shoal" and not _within(name, rule.allowed)
        ):
            found.append(Violation(path, line, name, rule))
    return found


def project_files() -> Iterator[Path]:
    for folder in (*FOLDERS, "tests", "bench"):
        yield from sorted((ROOT / folder).rglob("*.py"))
    yield ROOT / "shoal" / "__init__.py"


def test_every_module_keeps_the_floor_plan():
    violations = []
    for path in project_files():
        module = module_name(path) if path.parts[-2] != "shoal" else "shoal"
        rel = str(path.relative_to(ROOT))
        violations += check_source(path.read_text(), module, rel, path.name == "__init__.py")
    assert not violations, "\n".join(map(str, violations))


def test_only_the_bus_imports_nats():
    for path in project_files():
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("bus", "tests", "bench"):
            continue
        names = [name for _, name in imported_modules(path.read_text(), "x", False)]
        assert not [n for n in names if n.split(".")[0] == "nats"], f"{rel} imports nats"


def test_nothing_outside_the_composition_imports_gateway_or_deploy():
    for path in project_files():
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("deploy", "gateway", "tests", "bench", "shoal"):
            continue
        module = module_name(path)
        for line, name in imported_modules(path.read_text(), module, path.name == "__init__.py"):
            assert not _within(name, ("shoal.gateway", "shoal.deploy")), f"{rel}:{line} {name}"


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("shoal.engine.core.scheduler", "import torch", "torch"),
        (
            "shoal.engine.core.scheduler",
            "from shoal.bus.transport.nats_bus import NatsBus",
            "nats_bus",
        ),
        ("shoal.engine.core.scheduler", "from shoal.engine.client import router", "client"),
        ("shoal.engine.core.scheduler", "from ..actor import core_actor", "actor"),
        ("shoal.engine.core.scheduler", "def f():\n    import asyncio\n", "asyncio"),
        ("shoal.gateway.app", "from shoal.engine.core.request import Request", "core"),
        ("shoal.engine.client.router", "from shoal.engine.core import scheduler", "core"),
        ("shoal.gateway.app", "from shoal.deploy import llm", "deploy"),
        ("shoal.workers.actor", "from shoal.engine.core import config", "engine"),
        ("shoal.engine.actor.core_actor", "from shoal import workers", "workers"),
        ("shoal.engine.recovery.actor", "from shoal.engine.core import request", "core"),
        ("shoal.engine.recovery.actor", "from shoal.engine.actor import core_actor", "actor"),
        ("shoal.engine.recovery.policy", "import asyncio", "asyncio"),
        ("shoal.tiers.books.manager", "import asyncio", "asyncio"),
        ("shoal.tiers.books.policies.lru", "from shoal.bus.base import Bus", "bus"),
        ("shoal.tiers.cpu.actor", "from shoal.engine.core import request", "engine"),
        ("shoal.tiers.books.p2p_sessions", "import socket", "socket"),
        ("shoal.kernels.ops", "from shoal.bus.messages import worker", "bus"),
        ("shoal.bus.messages.worker", "from shoal.bus.base import Bus", "bus.base"),
        ("shoal.bus.base", "from engine.core import request", "engine"),
        ("tests.unit.test_x", "import bus.codec", "bus"),
    ],
)
def test_the_checker_catches_a_violation(module, source, expected):
    found = check_source(source, module, "probe.py")
    assert len(found) == 1 and expected in found[0].imported


def test_the_checker_lets_allowed_imports_through():
    allowed = [
        ("shoal.engine.core.scheduler", "from shoal.bus.messages.worker import ExecuteStep"),
        ("shoal.engine.actor.core_actor", "from shoal.engine.core.engine_core import EngineCore"),
        ("shoal.gateway.app", "from shoal.engine.client.interface import EngineClientInterface"),
        (
            "shoal.engine.client.prefix_routing",
            "from shoal.engine.core.block_hash import BlockHasher",
        ),
        ("shoal.workers.model_runner", "from shoal.kernels import ops\nimport torch"),
        ("shoal.deploy.llm", "from shoal.engine.actor import core_actor"),
        ("shoal.engine.recovery.actor", "from shoal.bus.runtime.actor import call"),
        ("shoal.engine.recovery.actor", "from shoal.engine.recovery.policy import GiveUp"),
    ]
    for module, source in allowed:
        assert check_source(source, module, "probe.py") == []


def test_the_docs_floor_plan_is_the_rules():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    start, end = doc.index(TABLE_START) + len(TABLE_START), doc.index(TABLE_END)
    assert doc[start:end].strip() == rules_table(), (
        "docs/architecture.md's rules table differs from RULES: rewrite it with "
        "python -m tests.unit.test_package_rules"
    )


if __name__ == "__main__":
    print(TABLE_START, rules_table(), TABLE_END, sep="\n")

"""The multi-LoRA group of the configuration (``LoRAConfig``, issue 34; vLLM's flags).

With ``enable_lora`` each worker keeps ``max_loras`` adapters resident in fixed slots (the most
distinct adapters one step may use: the scheduler admits no request whose adapter would make
more), each of rank at most ``max_lora_rank``, and ``max_cpu_loras`` more loaded in host memory
(least recently used ones evicted from either). ``lora_modules`` are the adapters served from
the start (``name=path`` or vLLM's JSON form); more can be loaded at run time.
"""

from __future__ import annotations

import msgspec

from shoal.config.validation import require

# vLLM's choices of --max-lora-rank
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoRAModule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One adapter served from the start (vLLM's ``--lora-modules`` JSON form)."""

    name: str
    path: str
    base_model_name: str = ""


class LoRAConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    enable_lora: bool = False
    max_loras: int = 1  # adapters resident per worker (one step's distinct adapters)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept in host memory (None: max_loras)
    lora_modules: tuple[LoRAModule, ...] = ()

    def __post_init__(self) -> None:
        require(self.max_loras >= 1, "max_loras", f"must be >= 1, got {self.max_loras}")
        require(
            self.max_lora_rank in LORA_RANKS,
            "max_lora_rank",
            f"must be one of {', '.join(map(str, LORA_RANKS))}, got {self.max_lora_rank}",
        )
        require(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            "max_cpu_loras",
            f"must be >= max_loras ({self.max_loras}), got {self.max_cpu_loras}",
        )
        require(
            self.enable_lora or not self.lora_modules,
            "lora_modules",
            "need enable_lora (--enable-lora)",
        )
        names = [m.name for m in self.lora_modules]
        require(len(set(names)) == len(names), "lora_modules", f"repeat a name: {names}")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def parse_lora_module(text: str) -> LoRAModule:
    """``name=path`` or the JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            return msgspec.json.decode(text, type=LoRAModule)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ValueError(f"--lora-modules {text!r}: {exc}") from exc
    name, sep, path = (part.strip() for part in text.partition("="))
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path or a JSON object")
    return LoRAModule(name=name, path=path)


def lora_modules(given: object) -> tuple[LoRAModule, ...]:
    """``lora_modules`` as given in options (modules, ``name=path`` strings, JSON objects or
    dicts) as the config keeps them."""
    if not isinstance(given, list | tuple):
        raise ValueError(f"lora_modules must be a list, got {given!r}")
    modules = []
    for item in given:
        if isinstance(item, LoRAModule):
            modules.append(item)
        elif isinstance(item, str):
            modules.append(parse_lora_module(item))
        elif isinstance(item, dict):
            modules.append(msgspec.convert(item, LoRAModule))
        else:
            raise ValueError(f"lora_modules: {item!r} is not name=path or an object")
    return tuple(modules)

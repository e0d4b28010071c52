"""The view directory of a GGUF checkpoint: the Hugging Face files every process reads, made
once from the file's metadata into the shoal cache, and a pointer back to the file.

The view holds ``config.json``, ``generation_config.json`` (BOS/EOS ids), the tokenizer
(transformers' GGUF tokenizer conversion, chat template included), the file's parsed index
(``INDEX_FILE``: metadata and where each tensor lies, so loads need not parse the file again)
and ``SOURCE_FILE``, written last, naming the GGUF file the workers read tensors from. Its
name keys on the file's resolved path, size and modification time, so a changed file gets a new
view.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from shoal.workers.built_dir import default_cache_root, ensure_built
from shoal.workers.gguf.errors import GGUFError

if TYPE_CHECKING:
    from shoal.workers.gguf.reader import GGUFFile

SOURCE_FILE = "shoal-gguf.json"
INDEX_FILE = "gguf-index.json"
VIEW_VERSION = "2"  # bumped when the view's files change shape
GGUF_MAGIC = b"GGUF"


def find_gguf_file(model: str | Path) -> Path | None:
    """The GGUF file ``model`` names: a ``.gguf`` file, or a directory with no ``config.json``
    holding exactly one; None for anything else (a Hugging Face directory)."""
    path = Path(model)
    if path.is_file():
        return path if _has_magic(path) else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files[:4])
        raise GGUFError(f"{path} holds several GGUF files ({names}): name the one to serve")
    return files[0] if files else None


def _has_magic(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def gguf_view(
    gguf_file: str | Path,
    *,
    cache_root: str | Path | None = None,
    log: Callable[[str], None] | None = None,
) -> Path:
    """The view directory of ``gguf_file``, made first if the cache does not hold it yet."""
    source = Path(gguf_file).resolve()
    stat = source.stat()
    key = xxhash.xxh3_64_hexdigest(
        f"{VIEW_VERSION}|{source}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    )
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    final = root / "gguf" / f"{source.stem[:64]}-{key}"
    return ensure_built(final, SOURCE_FILE, lambda building: _build(building, source, log))


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF file a view directory points at, or None for any other directory."""
    manifest = Path(model_dir) / SOURCE_FILE
    if not manifest.is_file():
        return None
    source = Path(json.loads(manifest.read_text())["gguf_file"])
    if not source.is_file():
        raise GGUFError(f"{model_dir}: its GGUF file {source} is gone")
    return source


def load_gguf(model_dir: str | Path) -> GGUFFile | None:
    """The GGUF file behind a view directory, from the view's index; None for any other."""
    from shoal.workers.gguf.reader import GGUFFile, GGUFIndex

    source = gguf_source(model_dir)
    if source is None:
        return None
    index = GGUFIndex.from_json((Path(model_dir) / INDEX_FILE).read_text())
    return GGUFFile(source, index)


def _build(building: Path, source: Path, log: Callable[[str], None] | None) -> dict[str, Any]:
    from shoal.workers.gguf.reader import GGUFFile

    started = time.monotonic()
    if log:
        log(f"GGUF: reading {source.name}'s metadata into {building.parent} (once)")
    gguf = GGUFFile(source)
    (building / INDEX_FILE).write_text(gguf.index.to_json())
    config = gguf.hf_config()
    _write_json(building / "config.json", config)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None}
    _write_json(building / "generation_config.json", generation)
    _save_tokenizer(source, building)
    return {
        "version": VIEW_VERSION,
        "gguf_file": str(source),
        "architecture": gguf.arch,
        "size": source.stat().st_size,
        "build_seconds": round(time.monotonic() - started, 1),
    }


def _save_tokenizer(source: Path, building: Path) -> None:
    """transformers' conversion of the file's tokenizer (``tokenizer.ggml.*``, the chat
    template) saved as a Hugging Face tokenizer."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    except (ValueError, KeyError, OSError, NotImplementedError) as exc:
        raise GGUFError(f"{source}: its tokenizer cannot be read ({exc})") from exc
    tokenizer.save_pretrained(str(building))


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2) + os.linesep)

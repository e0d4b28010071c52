"""The files a deployment's model options name, read on the host that builds the config
(``build_config``): ``--chat-template`` (and ``LLM(chat_template=...)``) as vLLM reads it, and
the directory of ``--generation-config DIR``, which must exist.

A chat template value is the contents of the file it names or, when no such file opens, the
value itself as the template. A value with none of a template's characters (``{``, ``}``, a
newline) that opens no file is a path that failed: a ``ValueError`` naming it, rather than a
template that would render the path."""

from __future__ import annotations

from pathlib import Path

from shoal.config.deployment import (
    GENERATION_CONFIG_AUTO,
    GENERATION_CONFIG_NONE,
    ShoalConfig,
)

TEMPLATE_CHARS = "{}\n"  # vLLM's: a value holding one of these may be a template


def load_chat_template(value: str) -> str:
    """The template ``value`` stands for: a file's text, or ``value`` itself."""
    try:
        return Path(value).read_text()
    except (OSError, ValueError) as error:  # ValueError: a NUL in the value
        if not any(char in value for char in TEMPLATE_CHARS):
            raise ValueError(
                f"The supplied chat template ({value}) looks like a file path, but it failed "
                f"to be opened. Reason: {error}"
            ) from error
        return value


def with_model_files(config: ShoalConfig) -> ShoalConfig:
    """The config with the files its model options name read here: ``chat_template`` as the
    template's text (``load_chat_template``), a ``generation_config`` directory that exists."""
    model = config.model_config
    generation = model.generation_config
    names_a_directory = generation not in (GENERATION_CONFIG_AUTO, GENERATION_CONFIG_NONE)
    if names_a_directory and not Path(generation).is_dir():
        raise ValueError(f"generation_config: directory not found: {generation}")
    if model.chat_template is None:
        return config
    return config.replace(chat_template=load_chat_template(model.chat_template))

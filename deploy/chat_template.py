"""``--chat-template`` (and ``LLM(chat_template=...)``) as vLLM reads it: the contents of the
file it names or, when no such file opens, the value itself as the template. A value with none
of a template's characters (``{``, ``}``, a newline) that opens no file is a path that failed:
a ``ValueError`` naming it, rather than a template that would render the path."""

from __future__ import annotations

from pathlib import Path

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

"""The engine client's tokenizer: a local HF tokenizer directory, loaded offline.

Owns encoding, decoding, the end-of-sequence ids (``generation_config.json`` plus the tokenizer's
own ``eos_token_id``), chat templating (with ``chat_options.ChatOptions``; a served template,
vLLM's ``--chat-template``, replaces the tokenizer's own) and the tokenizer's configuration as
served by ``/tokenizer_info`` (``tokenizer_config``). A model without a chat template gets
vLLM's ``MissingChatTemplateError`` (a 400) unless a template is passed in
(``FALLBACK_CHAT_TEMPLATE`` is a plain role-tagged one that callers may opt into).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shoal.engine.client.chat_options import ChatOptions, check_chat_options
from shoal.engine.client.errors import RequestValidationError

# A minimal template for models that ship none; used only when a caller opts in.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


# vLLM's answer (a 400) to a chat request for a model without a chat template.
MISSING_CHAT_TEMPLATE = (
    "As of transformers v4.44, default chat template is no longer allowed, so you must provide "
    "a chat template if the tokenizer does not define one."
)


class MissingChatTemplateError(RequestValidationError):
    """The model's tokenizer has no chat template, none is served and the request gave none."""

    def __init__(self) -> None:
        super().__init__(MISSING_CHAT_TEMPLATE, "chat_template")


class Tokenizer:
    """A thin, typed wrapper over a ``transformers`` tokenizer."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int] = ()) -> None:
        self.hf = hf_tokenizer
        self.eos_token_ids: list[int] = _unique(
            [*eos_token_ids, *_as_id_list(getattr(hf_tokenizer, "eos_token_id", None))]
        )
        self.all_special_ids: frozenset[int] = frozenset(hf_tokenizer.all_special_ids)
        self._single_token_text: dict[int, str] = {}

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        *,
        tokenizer_dir: str | Path | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> Tokenizer:
        """Load from a local model directory, or ``tokenizer_dir`` (never the network), with the
        model's generation EOS ids; ``chat_template`` (the served one) replaces the tokenizer's
        own."""
        from transformers import AutoTokenizer

        path = Path(model_dir)
        source = Path(tokenizer_dir) if tokenizer_dir is not None else path
        for directory in (path, source):
            if not directory.is_dir():
                raise FileNotFoundError(f"model directory not found: {directory}")
        hf = AutoTokenizer.from_pretrained(str(source), local_files_only=True, **kwargs)
        if chat_template is not None:
            hf.chat_template = chat_template
        return cls(hf, eos_token_ids=read_generation_eos_ids(path))

    @property
    def backend(self) -> Any | None:
        """The Rust ``tokenizers.Tokenizer`` behind a fast tokenizer, else None."""
        return getattr(self.hf, "backend_tokenizer", None)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own (for logprobs), cached."""
        text = self._single_token_text.get(token_id)
        if text is None:
            text = self.decode([token_id], skip_special_tokens=False)
            self._single_token_text[token_id] = text
        return text

    def apply_chat_template(
        self, messages: list[dict[str, Any]], options: ChatOptions | None = None
    ) -> str:
        """Render ``messages`` with the request's template, else the served or tokenizer's."""
        options = options or ChatOptions()
        check_chat_options(options, messages)
        if options.chat_template is None and not self.has_chat_template:
            raise MissingChatTemplateError()
        rendered = self.hf.apply_chat_template(
            messages, chat_template=options.chat_template, tokenize=False, **options.render_kwargs()
        )
        return str(rendered)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        options: ChatOptions | None = None,
        *,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Apply the chat template and tokenize. The template supplies any BOS itself, so the
        tokenizer's special tokens are added only when asked (vLLM's chat default: not)."""
        text = self.apply_chat_template(messages, options)
        return self.encode(text, add_special_tokens=add_special_tokens)


# init_kwargs that say where and how the tokenizer was loaded, not what it is.
_LOADING_KEYS = frozenset(
    {"vocab_file", "merges_file", "tokenizer_file", "name_or_path", "is_local", "local_files_only"}
)
# Settings every tokenizer has, read from the tokenizer itself when its init_kwargs lack them.
_ALWAYS = (
    "model_max_length",
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "added_tokens_decoder",
)


def tokenizer_config(hf_tokenizer: Any) -> dict[str, Any]:
    """A ``transformers`` tokenizer's configuration as JSON values (vLLM's ``/tokenizer_info``):
    its ``tokenizer_config.json`` settings (special tokens as their text, ``added_tokens_decoder``
    as id → text), ``tokenizer_class``, and ``chat_template`` when it has one. Where the files it
    was loaded from lie is left out."""
    init_kwargs = getattr(hf_tokenizer, "init_kwargs", None) or {}
    config = {k: _json_value(v) for k, v in init_kwargs.items() if k not in _LOADING_KEYS}
    for name in _ALWAYS:
        value = getattr(hf_tokenizer, name, None)
        if config.get(name) is None and value is not None:
            config[name] = _json_value(value)
    config["tokenizer_class"] = type(hf_tokenizer).__name__
    chat_template = getattr(hf_tokenizer, "chat_template", None)
    if chat_template:
        config["chat_template"] = _json_value(chat_template)
    return config


def _json_value(value: object) -> Any:
    """``value`` as JSON: mapping keys as strings, other objects (an ``AddedToken``: its text)
    as their ``str``."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_json_value(v) for v in value]
    return str(value)


def read_generation_eos_ids(model_dir: Path) -> list[int]:
    """``eos_token_id`` from ``generation_config.json`` (an int or a list), or []."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    config = json.loads(path.read_text())
    return _as_id_list(config.get("eos_token_id"))


def _as_id_list(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list | tuple):
        return [int(v) for v in value]
    return []


def _unique(ids: list[int]) -> list[int]:
    return list(dict.fromkeys(ids))

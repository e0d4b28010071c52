"""``tokenizer_config``: a loaded tokenizer's configuration as ``/tokenizer_info`` serves it."""

from __future__ import annotations

import json
from pathlib import Path

from shoal.engine.client.tokenizer import Tokenizer, tokenizer_config
from tests.fixtures.models import build_tokenizer


def test_config_of_a_loaded_tokenizer(tmp_path: Path) -> None:
    build_tokenizer(tmp_path)
    hf = Tokenizer.from_pretrained(tmp_path).hf
    assert "name_or_path" in hf.init_kwargs  # where it was loaded from: not served
    config = tokenizer_config(hf)
    assert json.loads(json.dumps(config)) == config  # plain JSON values throughout
    assert config["tokenizer_class"] == type(hf).__name__
    assert (config["bos_token"], config["eos_token"], config["unk_token"]) == (
        "<s>",
        "</s>",
        "<unk>",
    )
    assert config["added_tokens_decoder"] == {"0": "<unk>", "1": "<s>", "2": "</s>", "3": "<pad>"}
    assert config["model_max_length"] == hf.model_max_length and config["padding_side"] == "left"
    assert not {"name_or_path", "vocab_file", "is_local", "local_files_only"} & set(config)
    assert "chat_template" not in config
    hf.chat_template = "{{ messages }}"
    assert tokenizer_config(hf)["chat_template"] == "{{ messages }}"

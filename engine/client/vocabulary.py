"""Which token ids a model takes, by vLLM's rule (``InputProcessor._validate_model_input``).

A prompt's token id is valid from 0 up to the larger of the tokenizer's largest id and the
model's embedding size minus one: a model may have rows its tokenizer never produces (Qwen pads
its embedding past its tokenizer), and a tokenizer may have ids past the model's rows (the
placeholders of some multimodal models). Anything else is vLLM's "Token id N is out of
vocabulary". Sampling constraints (``logit_bias``, ``allowed_token_ids``, ``top_k``) are bounded
by the model's own vocabulary: the logits the sampler sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shoal.engine.client.model_info import read_vocab_size
from shoal.engine.client.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Vocabulary:
    tokenizer_max_id: int  # the largest id the tokenizer knows
    model_vocab_size: int  # the model's embedding rows and logits columns

    @property
    def max_prompt_id(self) -> int:
        return max(self.tokenizer_max_id, self.model_vocab_size - 1)

    def invalid_prompt_id(self, token_ids: Sequence[int]) -> str | None:
        """vLLM's reason ``token_ids`` cannot be a prompt (a negative id, or one past both the
        tokenizer and the model), or None."""
        if not token_ids:
            return None
        low, high = min(token_ids), max(token_ids)
        if low < 0:
            return f"Token id {low} is out of vocabulary"
        if high > self.max_prompt_id:
            return f"Token id {high} is out of vocabulary"
        return None


def read_vocabulary(tokenizer: Tokenizer, model_dir: Path) -> Vocabulary:
    """The tokenizer's largest id and the model's ``vocab_size`` (the tokenizer's size when the
    model's ``config.json`` gives none)."""
    max_id = max(tokenizer.hf.get_vocab().values(), default=len(tokenizer.hf) - 1)
    return Vocabulary(max_id, read_vocab_size(model_dir) or len(tokenizer.hf))

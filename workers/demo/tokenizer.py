"""The demo model's tokenizer: a byte-level BPE trained locally with ``tokenizers``.

``train_byte_level_bpe`` is also what tests use to get a real tokenizer in milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS)

# Each message: its role token, a newline, the content and EOS; the reply opens with <|assistant|>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
)


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A GPT-2-style byte-level BPE over ``texts`` with the demo's special tokens first."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    # Encoding a prompt prepends BOS, as Llama tokenizers do (the model trains on <s>-led text).
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tokenizer.token_to_id(BOS))],
    )
    return tokenizer


def wrap_for_transformers(
    tokenizer: Tokenizer, chat_template: str | None = CHAT_TEMPLATE
) -> PreTrainedTokenizerFast:
    """The ``transformers`` view of it: BOS/EOS/PAD named, role tokens special, chat template."""
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        wrapped.chat_template = chat_template
    return wrapped


def save_tokenizer(
    texts: Iterable[str], vocab_size: int, out_dir: Path, chat_template: str | None = CHAT_TEMPLATE
) -> PreTrainedTokenizerFast:
    """Train, wrap and ``save_pretrained`` into ``out_dir``; returns the wrapped tokenizer."""
    wrapped = wrap_for_transformers(train_byte_level_bpe(texts, vocab_size), chat_template)
    wrapped.save_pretrained(str(out_dir))
    return wrapped

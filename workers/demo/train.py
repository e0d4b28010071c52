"""Builds the demo checkpoint into a directory: tokenizer, a small Llama, brief CPU training.

Deterministic for a given spec, Python version and thread count: fixed seeds, a fixed step count
(never a time budget), samples drawn from a seeded generator.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from shoal.workers.demo.corpus import first_paragraph, iter_docstrings, zen_of_python
from shoal.workers.demo.spec import DemoSpec, Log
from shoal.workers.demo.tokenizer import save_tokenizer


def training_texts(tokenizer_free_seed: int) -> tuple[list[str], list[list[dict[str, str]]]]:
    """Plain documents and chat conversations, in a seeded order."""
    docs = list(iter_docstrings())
    texts = [d.text for d in docs]
    zen = zen_of_python()
    if zen:
        texts.append(zen)
    chats = [
        [
            {"role": "user", "content": f"What does {d.qualname} do?"},
            {"role": "assistant", "content": first_paragraph(d.text)},
        ]
        for d in docs
        if "." in d.qualname
    ]
    rng = random.Random(tokenizer_free_seed)
    rng.shuffle(texts)
    rng.shuffle(chats)
    return texts, chats


def token_stream(
    tokenizer: PreTrainedTokenizerFast, texts: list[str], chats: list[list[dict[str, str]]]
) -> torch.Tensor:
    """All samples as one 1-D stream: ``<s> text </s>`` and templated chats, interleaved."""
    eos = tokenizer.eos_token_id
    pieces = [[*tokenizer.encode(t), eos] for t in texts]
    for chat in chats:
        rendered = tokenizer.apply_chat_template(chat, tokenize=False)
        pieces.append(tokenizer.encode(rendered, add_special_tokens=False))
    order = random.Random(len(pieces)).sample(range(len(pieces)), len(pieces))
    flat = [token for i in order for token in pieces[i]]
    return torch.tensor(flat, dtype=torch.long)  # [num_tokens]


def llama_config(spec: DemoSpec, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    config.dtype = "float32"  # saved as config.json's "dtype"
    return config


def _learning_rate(spec: DemoSpec, step: int) -> float:
    warmup = max(1, spec.train_steps // 10)
    if step < warmup:
        return spec.learning_rate * (step + 1) / warmup
    progress = (step - warmup) / max(1, spec.train_steps - warmup)
    return spec.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: LlamaForCausalLM, stream: torch.Tensor, spec: DemoSpec, log: Log) -> float:
    """A fixed number of AdamW steps on random windows of ``stream``; returns the last loss."""
    generator = torch.Generator().manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=spec.learning_rate, betas=(0.9, 0.95), weight_decay=0.01
    )
    model.train()
    loss_value = float("nan")
    started = time.monotonic()
    for step in range(spec.train_steps):
        starts = torch.randint(
            0, len(stream) - spec.seq_len, (spec.batch_size,), generator=generator
        )
        batch = torch.stack([stream[s : s + spec.seq_len] for s in starts.tolist()])  # [B, T]
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(spec, step)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss_value = float(loss.item())
        if step % 25 == 0 or step == spec.train_steps - 1:
            elapsed = time.monotonic() - started
            progress = f"step {step + 1}/{spec.train_steps} loss {loss_value:.3f}"
            log(f"demo model: {progress} ({elapsed:.0f}s)")
    model.eval()
    return loss_value


def build_demo_checkpoint(out_dir: Path, spec: DemoSpec, log: Log) -> float:
    """Write a complete HF checkpoint into ``out_dir``; returns the final training loss."""
    texts, chats = training_texts(spec.seed)
    tokenizer = save_tokenizer(texts, spec.vocab_size, out_dir)
    stream = token_stream(tokenizer, texts, chats)
    log(f"demo model: tokenizer of {len(tokenizer)} tokens, {len(stream)} training tokens")
    torch.manual_seed(spec.seed)
    config = llama_config(spec, tokenizer)
    model = LlamaForCausalLM(config)
    num_params = sum(p.numel() for p in model.parameters())
    log(f"demo model: Llama with {num_params / 1e6:.1f}M parameters")
    final_loss = train(model, stream, spec, log)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(str(out_dir))
    return final_loss

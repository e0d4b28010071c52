"""GGUF checkpoints (llama.cpp's format), read with the ggml project's own ``gguf`` library.

A GGUF file (or a directory holding one) is served through a *view directory* in the shoal
cache (``view``): the Hugging Face files every process reads (``config.json``,
``generation_config.json``, the tokenizer with its chat template) made once from the file's
metadata, and a pointer back to the file, from which the workers read the tensors (``reader``),
dequantized at load or, for Q4_0/Q4_1/Q8_0 matrices the loader keeps quantized, as codes and
scales (``quantized_blocks``), renamed to Hugging Face names (``tensor_names``) with the Q/K
permutation of llama.cpp's converter undone.
"""

from shoal.workers.gguf.errors import GGUFError
from shoal.workers.gguf.view import (
    SOURCE_FILE,
    find_gguf_file,
    gguf_source,
    gguf_view,
    load_gguf,
)

__all__ = ["SOURCE_FILE", "GGUFError", "find_gguf_file", "gguf_source", "gguf_view", "load_gguf"]

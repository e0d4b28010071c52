"""Dequantize a GGUF checkpoint into a Hugging Face directory (safetensors, fp32, tokenizer and
chat template beside) that every engine of bench/peers.py loads, so all of them run the same
weights. transformers reads the GGUF (``gguf_file=``) and refuses ``save_pretrained`` on a model
it loaded so until its quantizer and ``quantization_config`` are dropped: they are here.

    python make_hf.py FILE.gguf OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def convert(gguf_file: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, name = str(gguf_file.parent), gguf_file.name
    model: Any = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


if __name__ == "__main__":
    convert(Path(sys.argv[1]), Path(sys.argv[2]))

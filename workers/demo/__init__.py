"""The built-in demo model: a small Llama briefly trained on Python's own docstrings.

``ensure_demo_model()`` returns the directory of a ready HF checkpoint (config.json,
model.safetensors, generation_config.json, tokenizer files with a chat template), building and
caching it the first time. ``python -m shoal.workers.demo`` does the same and prints the path.
"""

from shoal.workers.demo.build import DEMO_VERSION, default_cache_root, ensure_demo_model
from shoal.workers.demo.spec import DemoSpec

__all__ = ["DEMO_VERSION", "DemoSpec", "default_cache_root", "ensure_demo_model"]

"""The parent side of ``bench/peers.py``: its cache (vLLM's venv, the shared Hugging Face
directory), the workload, the engine worker processes and servers it drives one at a time, and
the report. The workers themselves are scripts in ``bench/peers_engines/``."""

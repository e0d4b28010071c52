"""bench/peers.py's transformers worker: transformers' best offline mode on the bench's Hugging
Face directory, as bench/throughput.py runs it (``load_hf`` and the left-padded static batches of
``run_hf_static``, imported from it), driven by ``worker_loop``. ``offline`` takes the batch size
(the parent sweeps a few); ``outputs`` runs each prompt alone (no padding) for the greedy
comparison. Run by path in shoal's interpreter: ``python hf_worker.py CONFIG FD``."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from worker_loop import WARMUP_TOKENS, Handler, Reply, main  # noqa: E402

DEVICE = "cpu"


class HfMeasures:
    """The static-batch rounds and the unpadded greedy outputs of one loaded model."""

    def __init__(self, model: Any, prompts: list[list[int]], max_tokens: int) -> None:
        self.model, self.prompts, self.max_tokens = model, prompts, max_tokens

    def handlers(self) -> dict[str, Handler]:
        return {"warmup": self.warmup, "offline": self.offline, "outputs": self.outputs}

    def warmup(self, command: dict[str, Any]) -> Reply:
        """A few tokens at every batch size the parent will time."""
        from bench.throughput import run_hf_static

        for batch in command["batches"]:
            small = self.prompts[: int(batch)]
            run_hf_static(self.model, (small, [WARMUP_TOKENS] * len(small)), int(batch), DEVICE)
        return {}

    def offline(self, command: dict[str, Any]) -> Reply:
        """Every prompt, in left-padded batches of ``batch``."""
        from bench.throughput import run_hf_static

        work = (self.prompts, [self.max_tokens] * len(self.prompts))
        run = run_hf_static(self.model, work, int(command["batch"]), DEVICE)
        return {"tokens": run["tokens"], "seconds": run["seconds"]}

    def outputs(self, command: dict[str, Any]) -> Reply:
        """The greedy token ids of the first ``num`` prompts, each generated alone."""
        import torch

        token_ids = []
        for prompt in self.prompts[: int(command["num"])]:
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = self.model.generate(
                    ids, do_sample=False, max_new_tokens=self.max_tokens, pad_token_id=0
                )
            token_ids.append(out[0, len(prompt) :].tolist())
        return {"token_ids": token_ids}


def load(config: dict[str, Any], prompts: list[list[int]]) -> tuple[dict[str, Handler], Reply]:
    """The model through bench/throughput.py's ``load_hf`` (eos disabled)."""
    import torch
    import transformers

    from bench.throughput import load_hf

    torch.set_num_threads(int(config["threads"]))
    args = SimpleNamespace(dtype=config["dtype"], device=DEVICE)
    model = load_hf(Path(config["model"]), args)  # type: ignore[arg-type]
    facts = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
    }
    return HfMeasures(model, prompts, int(config["max_tokens"])).handlers(), facts


if __name__ == "__main__":
    main(load)

"""Host A of ``bench/offload.py``'s p2p mode, in a process of its own (as another host would
be): an engine (workers, engine core, CPU tier, p2p tier) on the bench's NATS server runs the
first turns, prints their answers as one JSON line, lets its engine core go, and keeps its tiers
serving peers until its stdin closes.

    python bench/offload_host.py < job.json   # {"model", "nats_url", "namespace", ...}
"""

from __future__ import annotations

import asyncio
import json
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.offload_engine import Model, open_engine, turn


async def serve(job: dict[str, Any]) -> None:
    model = Model(Path(job["model"]), 0, job["kv_bytes_per_token"])
    args = SimpleNamespace(device=job["device"], max_model_len=job["max_model_len"])
    async with AsyncExitStack() as stack:
        engine = await open_engine(
            stack, model, args, job["nats_url"], job["namespace"], **job["options"]
        )
        answers = []
        for i, prompt in enumerate(job["prompts"]):
            done = await turn(engine, prompt, job["max_tokens"], f"first-{i}")
            answers.append(done.token_ids)
        await engine.stop_engine_core()
        print(json.dumps({"answers": answers}), flush=True)
        await asyncio.to_thread(sys.stdin.read)  # serve peers until told to go


def main() -> None:
    import torch

    torch.set_num_threads(1)
    asyncio.run(serve(json.loads(sys.stdin.readline())))


if __name__ == "__main__":
    main()

"""The command loop of every engine worker that ``bench/peers.py`` starts, and the measures
shared by the engines that take token-id prompts (shoal, vLLM).

A worker is a script run by path, in its engine's own interpreter (vLLM's venv for vLLM), so
this module imports the standard library only. ``sys.argv[1]`` is a JSON config file (model
directory, dtype, threads, the prompts file, max_tokens, ...), ``sys.argv[2]`` the number of a
pipe to write replies to. The worker loads its engine, replies ``{"ok": true, "load_s", ...}``,
then reads one JSON command per line on stdin (``{"op": "offline"}``, ...) and answers each
with one JSON line on the reply pipe, until ``{"op": "quit"}`` or end of input. Its stdout and
stderr (the engines' own logs) go wherever the parent pointed them: a log file.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

Reply = dict[str, Any]
Handler = Callable[[dict[str, Any]], Reply]
Generate = Callable[[list[list[int]], int], list[list[int]]]
Loader = Callable[[dict[str, Any], list[list[int]]], tuple[dict[str, Handler], Reply]]
WARMUP_PROMPTS = 8
WARMUP_TOKENS = 4


def send(reply: TextIO, message: Reply) -> None:
    reply.write(json.dumps(message) + "\n")
    reply.flush()


def error_reply(exc: BaseException) -> Reply:
    traceback.print_exc()
    sys.stderr.flush()
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}


def main(load: Loader) -> None:
    """Load the engine (timed), say so, then answer commands until told to quit."""
    config = json.loads(Path(sys.argv[1]).read_text())
    reply = os.fdopen(int(sys.argv[2]), "w")
    prompts = json.loads(Path(config["prompts_file"]).read_text())
    started = time.perf_counter()
    try:
        handlers, facts = load(config, prompts)
    except Exception as exc:
        send(reply, error_reply(exc))
        return
    send(reply, {"ok": True, "load_s": round(time.perf_counter() - started, 2), **facts})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            break
        try:
            send(reply, {"ok": True, **handlers[command["op"]](command)})
        except Exception as exc:
            send(reply, error_reply(exc))


class Measures:
    """Warm-up, the offline round, the single request and the greedy outputs, for an engine
    that generates from token-id prompts (greedy, eos ignored) with ``generate``."""

    def __init__(self, generate: Generate, prompts: list[list[int]], max_tokens: int) -> None:
        self.generate, self.prompts, self.max_tokens = generate, prompts, max_tokens
        self.last_outputs: list[list[int]] = []

    def handlers(self) -> dict[str, Handler]:
        return {
            "warmup": self.warmup,
            "offline": self.offline,
            "single": self.single,
            "outputs": self.outputs,
        }

    def timed(self, prompts: list[list[int]]) -> tuple[list[list[int]], Reply]:
        """Every prompt to ``max_tokens`` tokens; the token ids and the timing."""
        started = time.perf_counter()
        outputs = self.generate(prompts, self.max_tokens)
        seconds = time.perf_counter() - started
        tokens = sum(map(len, outputs))
        if tokens != len(prompts) * self.max_tokens:
            raise RuntimeError(f"{tokens} tokens made, {len(prompts) * self.max_tokens} asked")
        return outputs, {"tokens": tokens, "seconds": seconds}

    def warmup(self, command: dict[str, Any]) -> Reply:
        """A few tokens for the first prompts (untimed by the parent)."""
        self.generate(self.prompts[:WARMUP_PROMPTS], WARMUP_TOKENS)
        return {}

    def offline(self, command: dict[str, Any]) -> Reply:
        """Every prompt in one call; its outputs are kept for ``outputs``."""
        self.last_outputs, timing = self.timed(self.prompts)
        return timing

    def single(self, command: dict[str, Any]) -> Reply:
        """The first prompt alone."""
        return self.timed(self.prompts[:1])[1]

    def outputs(self, command: dict[str, Any]) -> Reply:
        """The greedy token ids of the first ``num`` prompts (from the last offline round)."""
        num = int(command["num"])
        if len(self.last_outputs) < num:
            self.last_outputs = self.timed(self.prompts[:num])[0]
        return {"token_ids": self.last_outputs[:num]}

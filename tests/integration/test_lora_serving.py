"""LoRA adapters through the gateway over the real engine stack (tiny random Llama, in-memory
bus), driven by the openai SDK and plain HTTP as vLLM's clients drive them: adapters listed with
their parent, a request's ``model`` picking its adapter (greedy text equal to transformers with
PEFT's adapter applied), run-time load and unload, vLLM's 404 for an unknown model, clean 400s
naming what is wrong with a bad adapter (the server unharmed), and prefix caching that never
shares a block between adapters."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import openai
import pytest
from safetensors.torch import load_file, save_file

from shoal.bus.errors import RemoteError
from shoal.bus.folder_objects import put_folder
from shoal.bus.streams import request_stream
from shoal.bus.subjects import Subjects
from shoal.config.lora import LoRAConfig, LoRAModule
from shoal.gateway.lora_adapters import LoRAAdapters
from shoal.gateway.nats_api import NatsApi
from shoal.gateway.serving import serving_context
from tests.fixtures.lora import build_adapter, hf_lora_greedy
from tests.fixtures.models import make_prompts
from tests.integration.served_stack import MODEL_NAME, served_stack

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
MAX_TOKENS = 8
PROMPT = make_prompts((37,), seed=8)[0]  # over two 16-token blocks


def adapters_for(model_dir: Path) -> LoRAAdapters:
    return LoRAAdapters(
        LoRAConfig(
            enable_lora=True,
            max_loras=2,
            max_lora_rank=16,
            lora_modules=(LoRAModule("a0", str(model_dir.parent / "a0")),),
        ),
        MODEL_NAME,
        num_layers=2,
    )


def bad_adapters(model_dir: Path, good: Path, out: Path) -> dict[str, tuple[Path, str]]:
    """Adapter folders each wrong in one way, and a word the 400 must name."""
    rank32 = build_adapter(model_dir, out / "rank32", seed=3, rank=32)
    alien = out / "alien"
    alien.mkdir()
    (alien / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    tensors = load_file(str(good / "adapter_model.safetensors"))
    renamed = {n.replace("q_proj", "c_attn"): t for n, t in tensors.items()}
    save_file(renamed, str(alien / "adapter_model.safetensors"))
    truncated = out / "truncated"
    truncated.mkdir()
    (truncated / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    data = (good / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    dora = out / "dora"
    dora.mkdir()
    config = json.loads((good / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes(data)
    return {
        "rank32": (rank32, "max_lora_rank"),
        "alien": (alien, "c_attn"),
        "truncated": (truncated, "truncated"),
        "dora": (dora, "DoRA"),
        "missing": (out / "nowhere", "no such adapter folder"),
    }


async def greedy_text(client: openai.AsyncOpenAI, model: str) -> str:
    answer = await client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert answer.model == model
    return answer.choices[0].text


async def test_adapters_served_by_name_and_loaded_at_run_time(tiny_checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint("llama")
    root = tmp_path / "adapters"
    root.mkdir()
    a0 = build_adapter(model_dir, root / "a0", seed=20)
    a1 = build_adapter(model_dir, root / "a1", seed=21, rank=16, alpha=32.0)
    bad = bad_adapters(model_dir, a0, root)
    loras = adapters_for(root / "base")
    await loras.load_modules()
    lora_options = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
    async with served_stack(model_dir, app_options={"loras": loras}, **lora_options) as served:
        url = served.url
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        tokenizer = served.stack.client.tokenizer
        expected = {
            name: tokenizer.decode(hf_lora_greedy(model_dir, path, [PROMPT], MAX_TOKENS)[0])
            for name, path in (("a0", a0), ("a1", a1), (MODEL_NAME, None))
        }
        assert len(set(expected.values())) == 3  # each adapter changes the answer

        models = {m.id: m for m in (await client.models.list()).data}
        assert set(models) == {MODEL_NAME, "a0"}
        assert models["a0"].parent == MODEL_NAME and models["a0"].root == str(a0)

        assert await greedy_text(client, "a0") == expected["a0"]
        assert await greedy_text(client, MODEL_NAME) == expected[MODEL_NAME]
        with pytest.raises(openai.NotFoundError, match=r"The model `a1` does not exist\."):
            await greedy_text(client, "a1")

        async with aiohttp.ClientSession() as session:
            load = {"lora_name": "a1", "lora_path": str(a1)}
            async with session.post(f"{url}/v1/load_lora_adapter", json=load) as response:
                assert response.status == 200, await response.text()
                assert "added successfully" in await response.text()
            async with session.post(f"{url}/v1/load_lora_adapter", json=load) as response:
                body = await response.json()
                assert response.status == 400 and "already been loaded" in body["error"]["message"]
            for name, (path, word) in bad.items():
                body_in = {"lora_name": name, "lora_path": str(path)}
                async with session.post(f"{url}/v1/load_lora_adapter", json=body_in) as response:
                    body = await response.json()
                assert response.status == 400, (name, body)
                assert word in body["error"]["message"], (name, body)
                assert body["error"]["type"] == "invalid_request_error"
            assert await greedy_text(client, "a1") == expected["a1"]  # nothing else stopped
            models = {m.id for m in (await client.models.list()).data}
            assert models == {MODEL_NAME, "a0", "a1"}

            unload = {"lora_name": "a1"}
            async with session.post(f"{url}/v1/unload_lora_adapter", json=unload) as response:
                assert response.status == 200 and "removed successfully" in await response.text()
            async with session.post(f"{url}/v1/unload_lora_adapter", json=unload) as response:
                assert response.status == 404
        with pytest.raises(openai.NotFoundError):
            await greedy_text(client, "a1")
        await served.wait_until_idle()


async def test_prefix_cache_never_shares_blocks_between_adapters(tiny_checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint("llama")
    root = tmp_path / "adapters"
    root.mkdir()
    build_adapter(model_dir, root / "a0", seed=20)
    lora_options = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
    loras = adapters_for(root / "base")
    await loras.load_modules()
    async with served_stack(model_dir, app_options={"loras": loras}, **lora_options) as served:
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
        kv = served.scheduler.kv_cache_manager
        first = await greedy_text(client, "a0")
        assert kv.prefix_cache_hits == 0
        base = await greedy_text(client, MODEL_NAME)  # the same prompt: a0's blocks not taken
        assert kv.prefix_cache_hits == 0
        assert await greedy_text(client, "a0") == first  # a0's own blocks are
        assert kv.prefix_cache_hits == 32
        assert await greedy_text(client, MODEL_NAME) == base
        assert kv.prefix_cache_hits == 64
        await served.wait_until_idle()


async def test_an_adapter_from_the_object_store_serves_by_name(tiny_checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Pushed to the deployment's object store, loaded as ``nats-object://NAME``: the gateway
    fetches it to check it and the worker fetches it to apply it (a missing one is a 400)."""
    model_dir = tiny_checkpoint("llama")
    root = tmp_path / "adapters"
    root.mkdir()
    a0 = build_adapter(model_dir, root / "a0", seed=20)
    expected = hf_lora_greedy(model_dir, a0, [PROMPT], MAX_TOKENS)[0]
    loras = adapters_for(root / "base")
    loras.cache_root = tmp_path / "gateway-cache"
    lora_options = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
    async with served_stack(model_dir, app_options={"loras": loras}, **lora_options) as served:
        bus = served.stack.client.bus
        bucket = Subjects().lora_bucket()  # the stack's namespace: the default
        store = await bus.open_object_store(bucket)
        await put_folder(store, "pushed", a0)
        loras.open_store = lambda: bus.open_object_store(bucket)
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
        async with aiohttp.ClientSession() as session:
            for name, status in (("pushed", 200), ("absent", 400)):
                load = {"lora_name": name, "lora_path": f"nats-object://{name}"}
                async with session.post(f"{served.url}/v1/load_lora_adapter", json=load) as r:
                    assert r.status == status, await r.text()
                    if status == 400:
                        assert "no such adapter" in (await r.json())["error"]["message"]
        answer = await greedy_text(client, "pushed")
        assert answer == served.stack.client.tokenizer.decode(expected)
        await served.wait_until_idle()


async def test_the_nats_api_serves_adapters_by_name(tiny_checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The gateway's NATS request/reply API shares the HTTP API's adapters: ``model`` names
    one (the answer says it), an unknown one is the same 404."""
    model_dir = tiny_checkpoint("llama")
    root = tmp_path / "adapters"
    root.mkdir()
    a0 = build_adapter(model_dir, root / "a0", seed=20)
    expected = hf_lora_greedy(model_dir, a0, [PROMPT], MAX_TOKENS)[0]
    loras = adapters_for(root / "base")
    await loras.load_modules()
    lora_options = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
    async with served_stack(model_dir, app_options={"loras": loras}, **lora_options) as served:
        client = served.stack.client
        api = NatsApi(
            client.bus, serving_context(client, served_model_name=MODEL_NAME, loras=loras)
        )
        await api.start()
        try:
            request = {
                "model": "a0",
                "prompt_token_ids": PROMPT,
                "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
            }
            subject = api.subjects.api_generate()
            replies = request_stream(client.bus, subject, json.dumps(request).encode(), timeout=30)
            body = [json.loads(m.data) async for m in replies][-1]
            assert body["model"] == "a0" and body["choices"][0]["token_ids"] == expected
            unknown = json.dumps({**request, "model": "a9"}).encode()
            with pytest.raises(RemoteError) as caught:
                async for _ in request_stream(client.bus, subject, unknown, timeout=30):
                    pass
            assert caught.value.code == "model_not_found"
        finally:
            await api.stop()
        await served.wait_until_idle()

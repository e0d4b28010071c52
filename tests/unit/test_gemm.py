"""The linear layers' matmul (``kernels.gemm``) and the packing step after loading
(``workers.layers.weight_packing``): which backend a device gets, packed products against
``F.linear``, and a loaded model whose weights were really packed and still answers as before."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from shoal.kernels import gemm
from shoal.kernels.strip_gemm import StripWeight, strip_gemm_available
from shoal.workers.layers.weight_packing import pack_linear_weights
from shoal.workers.loader import load_model
from shoal.workers.model_runner import ModelRunner
from shoal.workers.models.decoder import DecoderForCausalLM
from tests.fixtures.models import make_prompts
from tests.golden.driver import generate_by_hand, make_runner
from tests.unit.test_model_runner import BLOCK, full_logits

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)
needs_strips = pytest.mark.skipif(
    not strip_gemm_available(torch.float32), reason="the strip kernel has no path on this CPU"
)
PACKED_BACKENDS = [
    pytest.param(gemm.ONEDNN, marks=needs_onednn),
    pytest.param(gemm.STRIPS, marks=needs_strips),
]


def _is_packed_for(weight, backend: str) -> bool:  # type: ignore[no-untyped-def]
    if backend == gemm.STRIPS:
        return isinstance(weight, StripWeight)
    return isinstance(weight, torch.Tensor) and weight.is_mkldnn


@needs_onednn
def test_the_cpu_packs_fp32_and_bf16_and_leaves_the_rest_dense(monkeypatch):
    """Strips where the kernel has a path for the dtype, else oneDNN."""
    monkeypatch.delenv(gemm.ENV_VAR, raising=False)
    for dtype in (torch.float32, torch.bfloat16):
        expected = gemm.STRIPS if strip_gemm_available(dtype) else gemm.ONEDNN
        assert gemm.gemm_backend("cpu", dtype) == expected
    assert gemm.gemm_backend("cpu", torch.float16) == gemm.DENSE
    assert gemm.gemm_backend("cuda", torch.bfloat16) == gemm.DENSE


@needs_onednn
def test_the_environment_forces_a_backend_or_is_refused(monkeypatch):
    monkeypatch.setenv(gemm.ENV_VAR, "dense")
    assert gemm.gemm_backend("cpu", torch.float32) == gemm.DENSE
    monkeypatch.setenv(gemm.ENV_VAR, "onednn")
    assert gemm.gemm_backend("cpu", torch.float32) == gemm.ONEDNN
    with pytest.raises(RuntimeError, match="oneDNN"):
        gemm.gemm_backend("cpu", torch.float16)
    monkeypatch.setenv(gemm.ENV_VAR, "strips")
    with pytest.raises(RuntimeError, match="SHOAL_GEMM=strips"):
        gemm.gemm_backend("cpu", torch.float16)
    if strip_gemm_available(torch.float32):
        assert gemm.gemm_backend("cpu", torch.float32) == gemm.STRIPS
    monkeypatch.setenv(gemm.ENV_VAR, "mkl")
    with pytest.raises(ValueError, match="SHOAL_GEMM='mkl'"):
        gemm.gemm_backend("cpu", torch.float32)


@pytest.mark.parametrize("backend", PACKED_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("leading", [(0,), (1,), (37,), (3, 5)])
def test_a_packed_product_equals_f_linear(backend, dtype, leading):
    if backend == gemm.STRIPS and not strip_gemm_available(dtype):
        pytest.skip(f"the strip kernel has no {dtype} path on this CPU")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(*leading, 80, generator=gen).to(dtype)
    packed = gemm.pack_weight(weight, backend)
    assert _is_packed_for(packed, backend)
    assert packed.shape == weight.shape and packed.dtype == dtype
    assert torch.equal(packed.to_dense(), weight)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    for b in (None, bias):
        out = gemm.linear(x, packed, b)
        assert out.shape == (*leading, 96) and out.dtype == dtype
        torch.testing.assert_close(out.float(), F.linear(x, weight, b).float(), **tol)


def _linear_weights(model: DecoderForCausalLM) -> dict[str, Any]:
    weights = {n: m.weight for n, m in model.named_modules() if n.endswith("proj")}
    return {**weights, "lm_head": model.lm_head.head_weight()}


def _loaded_runner(model_dir, backend: str, monkeypatch) -> ModelRunner:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(gemm.ENV_VAR, backend)
    runner = make_runner(model_dir, num_blocks=64, block_size=BLOCK)
    runner.load()
    assert runner.gemm_backend == backend
    return runner


@pytest.mark.parametrize("backend", PACKED_BACKENDS)
@pytest.mark.parametrize("variant", ["llama_tied", "qwen2"])
def test_a_loaded_runner_packs_every_linear_and_keeps_its_logits(
    backend, variant, tiny_checkpoint, monkeypatch
):
    model_dir = tiny_checkpoint(variant)
    dense = _loaded_runner(model_dir, gemm.DENSE, monkeypatch)
    packed = _loaded_runner(model_dir, backend, monkeypatch)
    tied = packed.model.config.tie_word_embeddings
    assert tied == (variant == "llama_tied")
    weights = _linear_weights(packed.model)
    assert len(weights) > 2, weights.keys()
    assert all(_is_packed_for(w, backend) for w in weights.values()), weights
    assert not any(w.is_mkldnn for w in _linear_weights(dense.model).values())
    embedding = packed.model.model.embed_tokens.weight
    assert not embedding.is_mkldnn  # the embedding still looks rows up in its dense weight
    head = packed.model.lm_head.head_weight().to_dense()
    assert torch.equal(head, embedding) == tied
    expected = dense.model.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(packed.model.model.layers[0].mlp.gate_up_proj.weight.to_dense(), expected)
    prompt = list(range(3, 20))
    torch.testing.assert_close(
        full_logits(packed, prompt), full_logits(dense, prompt), atol=1e-4, rtol=1e-4
    )


def test_the_dense_backend_leaves_a_loaded_model_as_it_was(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv(gemm.ENV_VAR, "dense")
    model, _ = load_model(tiny_checkpoint("qwen2"), dtype=torch.float32)
    before = {n: p for n, p in model.named_parameters()}
    assert pack_linear_weights(model, "cpu", torch.float32) == gemm.DENSE
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[n] is p and not p.is_mkldnn for n, p in before.items())


@pytest.mark.parametrize("backend", [gemm.DENSE, *PACKED_BACKENDS])
def test_greedy_equals_transformers_on_either_backend(
    backend, tiny_checkpoint, hf_reference, monkeypatch
):
    model_dir = tiny_checkpoint("qwen2")
    runner = _loaded_runner(model_dir, backend, monkeypatch)
    prompts = make_prompts()
    assert generate_by_hand(runner, prompts, 8, BLOCK) == hf_reference(model_dir, prompts, 8)

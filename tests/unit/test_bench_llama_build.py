"""bench/peers_lib/llama_env.py: llama.cpp is built natively where the CPU has no AMX, and where
it has AMX for each of its other instruction sets by name, its AMX kernels left out (they crashed
on a Xeon with AMX), in a venv folder of its own."""

from __future__ import annotations

from bench.peers_lib.llama_env import cmake_args, llama_venv_spec

AVX512_AMX = {"sse4_2", "avx", "avx2", "bmi2", "fma", "f16c", "avx512f", "avx512_vnni"}
AVX512_AMX |= {"avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}


def test_a_cpu_without_amx_gets_a_native_build() -> None:
    flags = AVX512_AMX - {"amx_tile", "amx_int8", "amx_bf16"}
    assert cmake_args(flags) == "-DGGML_NATIVE=ON"
    assert llama_venv_spec(flags).folder == "llama-venv"


def test_a_cpu_with_amx_gets_its_other_instruction_sets_by_name() -> None:
    options = cmake_args(AVX512_AMX).split()
    assert options[0] == "-DGGML_NATIVE=OFF"
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON"} <= set(options)
    assert "-DGGML_AVX512_VBMI=OFF" in options and "-DGGML_AVX_VNNI=OFF" in options
    assert not any("AMX" in option for option in options)  # left at ggml's default: off
    spec = llama_venv_spec(AVX512_AMX)
    assert spec.folder == "llama-venv-no-amx" and spec.env["CMAKE_ARGS"] == " ".join(options)

"""The bench's figures: each engine's best round per measure, the serving levels side by side,
the per-dtype summary of ratios (shoal over vLLM: above 1 means shoal makes more tokens per
second; for inter-token latency, below 1 means shoal's tokens come sooner), and the printed
side-by-side table."""

from __future__ import annotations

from typing import Any

ENGINES = ("shoal", "vllm", "hf")
LABELS = {"shoal": "shoal", "vllm": "vLLM", "hf": "transformers"}


def rate(run: dict[str, Any]) -> float:
    """A run's tokens per second."""
    return float(run["tokens"] / max(run["seconds"], 1e-9))


def best_rate(runs: list[dict[str, Any]]) -> float | None:
    return round(max(map(rate, runs)), 1) if runs else None


def hf_batch_rates(runs: list[dict[str, Any]]) -> dict[str, float]:
    """transformers' best tok/s at each static batch size."""
    batches = sorted({int(run["batch"]) for run in runs})
    return {str(b): round(max(rate(run) for run in runs if run["batch"] == b), 1) for b in batches}


def engine_figures(runs: dict[str, Any]) -> dict[str, Any]:
    """One engine's best offline and single-request tok/s beside its raw runs."""
    figures = {
        "offline_tok_s": best_rate(runs["offline_runs"]),
        "single_tok_s": best_rate(runs["single_runs"]),
        **runs,
    }
    if any("batch" in run for run in runs["offline_runs"]):
        figures["batch_tok_s"] = hf_batch_rates(runs["offline_runs"])
    return figures


def level(serving: dict[str, Any] | None, concurrency: int) -> dict[str, Any] | None:
    """The serving summary's level at ``concurrency`` (None if it did not run)."""
    for lev in (serving or {}).get("levels", []):
        if lev.get("concurrency") == concurrency:
            return dict(lev)
    return None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def serve_figure(serving: dict[str, Any], name: str, concurrency: int, key: str) -> float | None:
    lev = level(serving.get(name), concurrency)
    return None if lev is None else lev.get(key)


def dtype_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The per-dtype line of the final JSON object."""
    offline, serving = result["offline"], result["serving"]

    def figure(name: str, key: str) -> float | None:
        return offline[name][key] if name in offline else None

    shoal_tok_s, vllm_tok_s = figure("shoal", "offline_tok_s"), figure("vllm", "offline_tok_s")
    summary: dict[str, Any] = {
        "shoal_tok_s": shoal_tok_s,
        "vllm_tok_s": vllm_tok_s,
        "hf_tok_s": figure("hf", "offline_tok_s"),
        "ratio": ratio(shoal_tok_s, vllm_tok_s),
        "hf_ratio": ratio(shoal_tok_s, figure("hf", "offline_tok_s")),
        "shoal_bs1_tok_s": figure("shoal", "single_tok_s"),
        "vllm_bs1_tok_s": figure("vllm", "single_tok_s"),
        "bs1_ratio": ratio(figure("shoal", "single_tok_s"), figure("vllm", "single_tok_s")),
    }
    for c in (1, 8, 32):
        pair = [serve_figure(serving, name, c, "tok_s") for name in ("shoal", "vllm")]
        summary[f"serve_ratio_c{c}"] = ratio(*pair)
        for q in (50, 99):
            itl = [serve_figure(serving, name, c, f"itl_ms_p{q}") for name in ("shoal", "vllm")]
            summary[f"itl_p{q}_ratio_c{c}"] = ratio(*itl)
    summary["agreement"] = {
        pair: f"{facts['identical']}/{facts['of']}" for pair, facts in result["agreement"].items()
    }
    return summary


def ratio_line(summary: dict[str, Any], concurrency: list[int]) -> str:
    """``shoal/vLLM: offline 0.53x, single request 0.49x, serve c=8 0.40x (ITL p50 2.97x)``."""
    parts = [f"offline {summary['ratio']}x", f"single request {summary['bs1_ratio']}x"]
    for c in concurrency:
        itl = summary[f"itl_p50_ratio_c{c}"]
        parts.append(f"serve c={c} {summary[f'serve_ratio_c{c}']}x (ITL p50 {itl}x)")
    return "shoal/vLLM: " + ", ".join(parts)


def cell(value: float | None, width: int = 12) -> str:
    return f"{'-' if value is None else f'{value:.1f}':>{width}}"


def table(dtype: str, result: dict[str, Any]) -> list[str]:
    """The side-by-side lines of one dtype."""
    offline, serving = result["offline"], result["serving"]
    names = [n for n in ENGINES if n in offline or n in serving]
    lines = [f"{'== ' + dtype:<24}" + "".join(f"{LABELS[n]:>14}" for n in names)]

    def row(label: str, values: list[float | None]) -> None:
        lines.append(f"{label:<24}" + "".join(cell(v, 14) for v in values))

    row("offline tok/s", [offline.get(n, {}).get("offline_tok_s") for n in names])
    row("single request tok/s", [offline.get(n, {}).get("single_tok_s") for n in names])
    row("load s", [offline.get(n, {}).get("load_s") for n in names])
    row("server startup s", [serving.get(n, {}).get("startup_s") for n in names])
    for c in result["concurrency"]:
        for key, label in (
            ("tok_s", "tok/s"),
            ("ttft_ms_p50", "TTFT p50 ms"),
            ("itl_ms_p50", "ITL p50 ms"),
            ("itl_ms_p99", "ITL p99 ms"),
        ):
            row(f"serve c={c} {label}", [serve_figure(serving, n, c, key) for n in names])
    if "hf" in offline and offline["hf"].get("batch_tok_s"):
        batches = ", ".join(f"b={b}: {v}" for b, v in offline["hf"]["batch_tok_s"].items())
        lines.append(f"transformers static batches: {batches}")
    lines.append(ratio_line(dtype_summary(result), result["concurrency"]))
    for name in names:
        for what in ("offline", "serving"):
            error = (offline if what == "offline" else serving).get(name, {}).get("error")
            if error:
                lines.append(f"{LABELS[name]} {what}: {error}")
    return lines

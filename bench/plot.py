"""A benchmark's figures as one PNG (``shoal bench NAME --plot FILE``), drawn from its result:
the JSON object every benchmark prints as its last line.

The panels follow the result's shape, not the benchmark's name (``panels`` is pure):

* a list of records (a sweep: ``bench/serve.py``'s levels) gives one panel per numeric field
  against the records' x (concurrency, request rate, batch size, ...), a line per label (mode,
  policy, engine, ...) and per quantile (``ttft_ms_p50`` and ``_p99`` share a panel):
  throughput and latency against concurrency or rate;
* a mapping of number lists (``bench/recovery.py``'s recovery times per fault) gives points in
  the order they happened: a timeline;
* a mapping of numbers (TTFT per tier, restart time per kind) gives bars, and a mapping of such
  mappings (hit rate per policy) a panel of bars per inner figure;
* the top-level numbers are listed in a panel of their own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

X_KEYS = ("concurrency", "request_rate", "rate", "batch_size", "num_seqs", "num_prompts",
          "num_speculative_tokens", "k", "input_len", "prompt_len", "context_len")  # fmt: skip
LABEL_KEYS = ("mode", "name", "policy", "side", "engine", "backend", "kind", "method", "model")
MAX_PANELS = 12
MAX_LIST_FIELDS = 6  # of one sweep's fields, the first ones
SKIP_FIELDS = ("num_failed", "num_requests", "seed")  # counts, not figures, in a sweep


@dataclass
class Panel:
    """One chart: ``lines`` or ``points`` (name → [(x, y)]), ``bars`` (name → value), or
    ``text`` (name → value, listed)."""

    title: str
    kind: str
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    values: dict[str, float] = field(default_factory=dict)
    xlabel: str = ""


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def panels(result: Mapping[str, Any]) -> list[Panel]:
    """The panels of ``result`` (at most ``MAX_PANELS``; the top-level numbers last)."""
    found = [panel for key, value in result.items() for panel in _panels_of(key, value)]
    numbers = {key: float(value) for key, value in result.items() if is_number(value)}
    if not numbers:
        return found[:MAX_PANELS]
    return [*found[: MAX_PANELS - 1], Panel("figures", "text", values=numbers)]


def _panels_of(key: str, value: Any) -> list[Panel]:
    if isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        return _sweep(key, value)
    if isinstance(value, list) and len(value) > 1 and all(is_number(v) for v in value):
        return [Panel(key, "points", {key: list(enumerate(map(float, value)))}, xlabel="n")]
    if not isinstance(value, Mapping) or not value:
        return []
    if all(is_number(v) for v in value.values()):
        return [Panel(key, "bars", values={k: float(v) for k, v in value.items()})]
    if all(isinstance(v, list) and all(is_number(x) for x in v) for v in value.values()):
        series = {k: [(float(i), float(x)) for i, x in enumerate(v)] for k, v in value.items()}
        return [Panel(key, "points", series, xlabel="n (in order)")]
    if all(isinstance(v, Mapping) for v in value.values()):
        return _grouped(key, value)
    return []


def _grouped(key: str, value: Mapping[str, Mapping[str, Any]]) -> list[Panel]:
    """``{outer: {figure: number}}``: a bars panel per figure, a bar per outer key."""
    figures: dict[str, dict[str, float]] = {}
    for outer, inner in value.items():
        for name, number in inner.items():
            if is_number(number):
                figures.setdefault(name, {})[outer] = float(number)
    return [Panel(f"{key}: {name}", "bars", values=bars) for name, bars in figures.items()]


def _sweep(key: str, records: Sequence[Mapping[str, Any]]) -> list[Panel]:
    """Records of a sweep: each numeric field against their x (records with different x keys,
    such as concurrency and request-rate levels, in panels of their own), a line per label."""
    groups: dict[str | None, list[Mapping[str, Any]]] = {}
    for record in records:
        x_key = next((k for k in X_KEYS if is_number(record.get(k))), None)
        groups.setdefault(x_key, []).append(record)
    found = []
    for x_key, group in groups.items():
        for panel in _sweep_group(key, x_key, group):
            if len(groups) > 1:
                panel.title = f"{panel.title} by {x_key or 'n'}"
            found.append(panel)
    return found


def _sweep_group(key: str, x_key: str | None, records: Sequence[Mapping[str, Any]]) -> list[Panel]:
    labels = (k for k in LABEL_KEYS if any(isinstance(r.get(k), str) for r in records))
    label_key = next(labels, None)
    fields = [
        name
        for name in dict.fromkeys(name for r in records for name in r)
        if name not in (label_key, *X_KEYS, *SKIP_FIELDS)
        and any(is_number(r.get(name)) for r in records)
    ]
    by_stem: dict[str, Panel] = {}
    for name in fields:
        stem, quantile = split_quantile(name)
        if stem not in by_stem and len(by_stem) == MAX_LIST_FIELDS:
            continue
        panel = by_stem.setdefault(stem, Panel(stem, "lines", xlabel=x_key or "n"))
        for index, record in enumerate(records):
            x = record.get(x_key) if x_key else index
            y = record.get(name)
            if is_number(x) and is_number(y):
                label = str(record.get(label_key, key)) if label_key else ""
                line = " ".join(part for part in (label, quantile) if part) or key
                panel.series.setdefault(line, []).append((float(x), float(y)))  # type: ignore[arg-type]
    return [panel for panel in by_stem.values() if panel.series]


def split_quantile(name: str) -> tuple[str, str]:
    """``ttft_ms_p99`` → (``ttft_ms``, ``p99``): a figure's quantiles share a panel."""
    stem, _, tail = name.rpartition("_")
    if stem and len(tail) > 1 and tail[0] == "p" and tail[1:].isdigit():
        return stem, tail
    return name, ""


def draw(figure_panels: Sequence[Panel], path: Path, title: str) -> None:
    """Write ``figure_panels`` as one PNG at ``path`` (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    count = max(1, len(figure_panels))
    columns = min(3, count)
    rows = math.ceil(count / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False)
    for axis, panel in zip(axes.flat, figure_panels, strict=False):
        _draw_panel(axis, panel)
    for axis in list(axes.flat)[len(figure_panels) :]:
        axis.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _draw_panel(axis: Any, panel: Panel) -> None:
    axis.set_title(panel.title, fontsize=10)
    if panel.kind == "text":
        axis.axis("off")
        lines = [f"{name}: {value:g}" for name, value in panel.values.items()]
        axis.text(0.0, 1.0, "\n".join(lines[:20]), va="top", family="monospace", fontsize=8)
        return
    if panel.kind == "bars":
        names = list(panel.values)
        axis.barh(names, [panel.values[n] for n in names])
        axis.invert_yaxis()
        return
    style = "o-" if panel.kind == "lines" else "o"
    for label, points in panel.series.items():
        xs, ys = zip(*sorted(points) if panel.kind == "lines" else points, strict=True)
        axis.plot(xs, ys, style, label=label, markersize=4)
    axis.set_xlabel(panel.xlabel)
    if len(panel.series) > 1:
        axis.legend(fontsize=8)
    axis.grid(alpha=0.3)


def last_result(output: str) -> dict[str, Any] | None:
    """The benchmark's result: its last output line that is a JSON object."""
    import json

    for line in reversed(output.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None

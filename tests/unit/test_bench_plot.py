"""``shoal bench NAME --plot FILE``: a benchmark's result (its last JSON line) drawn as one PNG,
the panels following the result's shape: a sweep's fields against concurrency or rate with a
line per mode, a timeline of number lists, bars of a mapping (and of each figure of a mapping of
mappings), the top-level numbers listed; the flag taken out of the benchmark's own arguments."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench.plot import draw, last_result, panels
from shoal.deploy import cli

SERVE_LIKE = {
    "levels": [
        {"mode": "concurrency", "concurrency": 1, "tok_s": 60.0, "ttft_ms_p50": 50.0,
         "ttft_ms_p99": 90.0, "num_requests": 32, "errors": {}},
        {"mode": "concurrency", "concurrency": 8, "tok_s": 230.0, "ttft_ms_p50": 250.0,
         "num_requests": 32, "errors": {}},
        {"mode": "rate", "request_rate": 2.0, "tok_s": 120.0, "ttft_ms_p50": 80.0},
    ],
    "num_failed": 0,
    "prompts": "distinct",
}  # fmt: skip


X_TITLES = ("concurrency", "request_rate")


def by_title(result: dict[str, object]) -> dict[str, object]:
    return {panel.title: panel for panel in panels(result)}


def test_a_sweep_gives_each_figure_against_its_x_a_line_per_mode() -> None:
    found = by_title(SERVE_LIKE)
    titles = {f"{name} by {x}" for name in ("tok_s", "ttft_ms") for x in X_TITLES}
    assert set(found) == {*titles, "figures"}  # counts and strings left out
    tok_s = found["tok_s by concurrency"]
    assert tok_s.kind == "lines" and tok_s.xlabel == "concurrency"  # type: ignore[attr-defined]
    assert tok_s.series == {"concurrency": [(1.0, 60.0), (8.0, 230.0)]}  # type: ignore[attr-defined]
    assert found["tok_s by request_rate"].series == {"rate": [(2.0, 120.0)]}  # type: ignore[attr-defined]
    ttft = found["ttft_ms by concurrency"].series  # type: ignore[attr-defined]
    assert ttft == {
        "concurrency p50": [(1.0, 50.0), (8.0, 250.0)],
        "concurrency p99": [(1.0, 90.0)],
    }
    one_kind = {"levels": SERVE_LIKE["levels"][:2]}  # type: ignore[index]
    assert set(by_title(one_kind)) == {"tok_s", "ttft_ms"}
    assert found["figures"].values == {"num_failed": 0.0}  # type: ignore[attr-defined]


def test_timelines_bars_and_grouped_bars() -> None:
    result = {
        "recover_s": {"inject": [0.5, 0.4, 0.6], "kill": [2.0, 2.5]},
        "ttft_ms": {"gpu": 20.0, "cpu": 35.0, "fs": 60.0},
        "policies": {"lru": {"hit_rate": 0.4, "ttft_hot_ms": 30.0}, "arc": {"hit_rate": 0.5}},
        "outputs_equal": True,
    }
    found = by_title(result)
    assert found["recover_s"].kind == "points"  # type: ignore[attr-defined]
    assert found["recover_s"].series["kill"] == [(0.0, 2.0), (1.0, 2.5)]  # type: ignore[attr-defined]
    assert found["ttft_ms"].values == {"gpu": 20.0, "cpu": 35.0, "fs": 60.0}  # type: ignore[attr-defined]
    assert found["policies: hit_rate"].values == {"lru": 0.4, "arc": 0.5}  # type: ignore[attr-defined]
    assert found["policies: ttft_hot_ms"].values == {"lru": 30.0}  # type: ignore[attr-defined]
    assert "figures" not in found  # a bool is not a figure


def test_the_png_is_drawn_and_the_last_json_line_is_the_result(tmp_path: Path) -> None:
    output = 'warming up\n{"not": "this"}\nlevel 1: 60 tok/s\n' + json.dumps(SERVE_LIKE)
    assert last_result(output) == SERVE_LIKE
    assert last_result("no json here\n{broken") is None
    path = tmp_path / "serve.png"
    draw(panels(SERVE_LIKE), path, "shoal bench serve")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_shoal_bench_plot_runs_the_benchmark_without_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench_dir = tmp_path / "bench"
    bench_dir.mkdir()
    (bench_dir / "fake.py").write_text(
        "import json, sys\n"
        "print('args', sys.argv[1:])\n"
        "print(json.dumps({'restart_s': {'worker': 8.0, 'engine': 1.2}, 'requests_lost': 0}))\n"
    )
    monkeypatch.setattr(cli, "BENCH_DIR", bench_dir)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    path = tmp_path / "fake.png"
    assert cli.main(["bench", "fake", "--rate", "2", "--plot", str(path), "--quick"]) == 0
    assert "args ['--rate', '2', '--quick']" in capsys.readouterr().out  # shown as it ran
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert cli.main(["bench", "fake", f"--plot={tmp_path / 'b.png'}"]) == 0
    assert (tmp_path / "b.png").is_file()

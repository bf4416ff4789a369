"""Plots of `pdserve bench`: synthetic runs where long prompts stall the short streams."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench import plots
from pdserve.bench.summary import RequestRecord

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LONG_ARRIVALS = (2.0, 5.0, 8.0)  # send times of the long prompts
PREFILL_S = 0.4  # how long each long prompt's prefill stalls decoding, when it does


def stream(index: int, cls: str, sent: float, tokens: int, prompt: int, stalls: bool) -> RequestRecord:
    """Chunks every 20 ms; a gap that runs into a long prefill lasts until that prefill ends."""
    times = [sent + 0.05]
    while len(times) < tokens:
        t = times[-1] + 0.02
        for start in LONG_ARRIVALS:
            if stalls and start <= t < start + PREFILL_S:
                t = start + PREFILL_S
        times.append(t)
    times.append(times[-1])  # two chunks in one read: a zero gap must not break a log axis
    return RequestRecord(index, cls, sent, sent, prompt, len(times), times)


def workload(stalls: bool) -> list[RequestRecord]:
    records = [stream(i, "chat", 0.7 * i, 40, 100, stalls) for i in range(14)]
    for k, start in enumerate(LONG_ARRIVALS):
        long = stream(100 + k, "doc", start, 5, 4000, stalls=False)
        long.chunk_times_s = [t + PREFILL_S for t in long.chunk_times_s]  # first chunk after prefill
        records.append(long)
    records.append(RequestRecord(200, "chat", 3.0, 3.0, 100, error="HTTP 503"))
    return records


def assert_png(path: Path, min_bytes: int = 5000) -> None:
    assert path.is_file()
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > min_bytes


def test_synthetic_run_has_spikes_at_long_arrivals() -> None:
    """The data the other tests draw: short-stream gaps spike exactly in the long prefill windows."""
    records = workload(stalls=True)
    assert plots._pick_long_class(records) == "doc"
    gaps = plots._gaps(records, "doc")
    spikes = [t for t, ms in gaps if ms > 100]
    assert spikes and all(any(abs(t - (a + PREFILL_S)) < 1e-9 for a in LONG_ARRIVALS) for t in spikes)
    assert max(ms for _, ms in plots._gaps(workload(stalls=False), "doc")) < 25


def test_plot_run_writes_cdfs_and_timeline(tmp_path: Path) -> None:
    paths = plots.plot_run(workload(stalls=True), tmp_path / "plots")
    assert [p.name for p in paths] == ["ttft_cdf.png", "itl_cdf.png", "itl_timeline.png"]
    for path in paths:
        assert_png(path, 10_000)


def test_cdfs_of_selected_classes_and_timeline_options(tmp_path: Path) -> None:
    records = workload(stalls=True)
    paths = plots.plot_cdfs({"run": records}, tmp_path, classes=["chat"])
    assert [p.name for p in paths] == ["ttft_cdf.png", "itl_cdf.png"]
    for path in paths:
        assert_png(path)
    one_class = [r for r in records if r.cls == "chat"]  # no markers, all streams drawn
    assert_png(plots.plot_itl_timeline(one_class, tmp_path / "one.png", title="chat only"))
    only_long = [r for r in records if r.cls == "doc"]  # markers but no gaps to draw
    assert_png(plots.plot_itl_timeline(only_long, tmp_path / "long.png", long_class="doc"))


def test_comparison_overlays_runs_and_shares_timeline_axes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limits: dict[str, tuple[object, object]] = {}
    save = plots._save

    def recording_save(fig, path):  # type: ignore[no-untyped-def]
        ax = fig.axes[0]
        limits[path.name] = (ax.get_xlim(), ax.get_ylim())
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", recording_save)
    runs = {"colocated": workload(stalls=True), "disaggregated": workload(stalls=False)}
    paths = plots.plot_comparison(runs, tmp_path)
    names = [p.name for p in paths]
    assert names == [
        "ttft_cdf.png",
        "itl_cdf.png",
        "itl_timeline_colocated.png",
        "itl_timeline_disaggregated.png",
    ]
    for path in paths:
        assert_png(path)
    assert limits["itl_timeline_colocated.png"] == limits["itl_timeline_disaggregated.png"]


def test_no_completed_requests_draws_a_message(tmp_path: Path) -> None:
    failed = [RequestRecord(0, "chat", 0.0, 0.0, 10, error="connection refused")]
    for path in plots.plot_run([], tmp_path / "empty"):
        assert_png(path, 1000)
    for path in plots.plot_run(failed, tmp_path / "failed"):
        assert_png(path, 1000)
    paths = plots.plot_comparison({"a b": failed, "a/b": []}, tmp_path / "cmp")
    assert [p.name for p in paths][2:] == ["itl_timeline_a_b.png", "itl_timeline_a_b_1.png"]
    for path in paths:
        assert_png(path, 1000)


def test_import_is_lazy_and_plotting_avoids_pyplot(tmp_path: Path) -> None:
    """`pdserve bench` without plots must not pay for matplotlib (or torch); plotting must not
    register figures with pyplot, whose global list keeps them alive until closed."""
    code = (
        "import sys\n"
        "import pdserve.bench.plots as plots\n"
        "assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules, sorted(sys.modules)\n"
        f"plots.plot_run([], {str(tmp_path)!r})\n"
        "assert 'matplotlib' in sys.modules and 'matplotlib.pyplot' not in sys.modules\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_timeline_plot_of_a_stepped_run(tmp_path: Path) -> None:
    from test_bench_timeline import SLOS, stepped_run

    from pdserve.bench.distributions import Step
    from pdserve.bench.timeline import build_timeline

    records, samples = stepped_run()
    steps = [("chat", Step(40.0, 20.0, 3.0))]
    timeline = build_timeline(records, 125.0, SLOS, 10.0, samples, steps, 2.0)
    assert_png(plots.plot_timeline(timeline, tmp_path / "timeline.png"), 20_000)
    # Redrawn from summary.json as written (JSON round trip), and with nothing to draw.
    again = json.loads(json.dumps(timeline))
    assert_png(plots.plot_timeline(again, tmp_path / "again.png", title="planner"), 20_000)
    bare = build_timeline(records, 125.0, None, 10.0)  # no pools, no SLOs
    assert_png(plots.plot_timeline(bare, tmp_path / "bare.png"))
    assert_png(plots.plot_timeline(build_timeline([], 0.0), tmp_path / "empty.png"), 1000)


def test_timelines_of_a_comparison_share_their_axes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_bench_timeline import SLOS, sample, stepped_run

    from pdserve.bench.timeline import build_timeline

    limits: dict[str, tuple[object, object]] = {}
    save = plots._save

    def recording_save(fig, path):  # type: ignore[no-untyped-def]
        limits[path.name] = (fig.axes[0].get_xlim(), fig.axes[0].get_ylim())
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", recording_save)
    records, samples = stepped_run()
    planner = build_timeline(records, 125.0, SLOS, 10.0, samples)
    static = build_timeline(records[:50], 60.0, SLOS, 10.0, [sample(0.0, decode=(4, ["up"] * 4))])
    paths = plots.plot_timelines({"planner": planner, "static pools": static}, tmp_path)
    assert [p.name for p in paths] == ["timeline_planner.png", "timeline_static_pools.png"]
    for path in paths:
        assert_png(path)
    assert limits["timeline_planner.png"] == limits["timeline_static_pools.png"] == ((0.0, 125.0), (0.0, 5.0))

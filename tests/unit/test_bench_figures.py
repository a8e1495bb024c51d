"""Figures of benchmarks/README.md read from the JSON files it cites: a figure that drifts from its file fails."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
README = (BENCH / "README.md").read_text()


def result(name: str) -> Any:
    return json.loads((BENCH / "results" / name).read_text())


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def test_the_4gib_runs_peaks_are_gib_of_their_bytes() -> None:
    runs = result("scale-4g.json")["runs"]
    paged = runs["paged_2_2e9"]["results"][0]
    search = runs["search"]["results"][-1]
    assert f"trained 2.18B, the one size tried (10.2x), at a peak of {gib(paged['peak_nbytes'])}" in README
    assert f"every size, with a peak of {gib(search['peak_nbytes'])} at 2B." in README


def test_the_gpu_checks_paging_request_counts_are_the_pagers() -> None:
    paging = result("gpu-check-h200.json")["paging"]
    paged, window = paging["paged"], paging["paged_16MiB_window"]
    row = (
        f"({paged['step_over_unpaged']:.2f}x), {paged['pager']['requests']:,.0f} requests; with a 16 MiB window "
        f"{window['step_s']:.3f} s ({window['step_over_unpaged']:.2f}x), {window['pager']['requests']:,.0f} requests"
    )
    assert row in README


def test_the_layout_runs_request_counts_are_the_pagers() -> None:
    for name, words in (
        ("scale-layout-2b-fp32-auto.json", "fp32 at 2B: {:,} requests"),
        ("scale-layout-2b-bf16-auto.json", "the default settings send the same {:,} requests"),
    ):
        (run,) = result(name)["results"]
        assert words.format(run["pager_requests"]) in README.replace("\n", " "), name


def test_tables_of_overwritten_files_name_the_commit_that_holds_them() -> None:
    for name in ("memory-after.json", "memory-release.json"):
        assert f"`benchmarks/results/{name}` as of commit 7321051" in README.replace("\n", " ")

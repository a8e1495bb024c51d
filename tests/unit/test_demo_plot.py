"""The demo's loss-curve PNG and its smoothing."""

from __future__ import annotations

import sys

import pytest

from tiermem.client.demo.plot import PlotUnavailable, plot_losses, smooth
from tiermem.client.demo.train import RunResult


def test_smooth_is_a_trailing_mean():
    assert smooth([4.0, 2.0, 6.0, 0.0], 2) == [4.0, 3.0, 4.0, 3.0]
    assert smooth([1.0, 2.0, 3.0], 10) == [1.0, 1.5, 2.0]
    assert smooth([], 3) == []
    with pytest.raises(ValueError, match="window must be >= 1"):
        smooth([1.0], 0)


def test_plot_losses_writes_a_png_of_every_run(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    runs = [RunResult("adamw", losses=[5.0 - 0.1 * i for i in range(40)]),
            RunResult("offload-cpu", losses=[5.0 - 0.1 * i for i in range(40)])]  # fmt: skip
    written = plot_losses(runs, tmp_path / "loss.png")
    assert written == (tmp_path / "loss.png").absolute()
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(written)
    assert pixels.shape[:2] == (450, 800)
    assert pixels.std() > 0  # something was drawn


def test_plot_losses_refuses_empty_runs(tmp_path):
    with pytest.raises(ValueError, match="no losses to plot"):
        plot_losses([RunResult("adamw")], tmp_path / "loss.png")
    assert not (tmp_path / "loss.png").exists()


def test_without_matplotlib_the_plot_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(PlotUnavailable, match=r"needs matplotlib .*pip install 'tiermem\[plot\]'"):
        plot_losses([RunResult("adamw", losses=[1.0, 0.5])], tmp_path / "loss.png")
    assert not (tmp_path / "loss.png").exists()

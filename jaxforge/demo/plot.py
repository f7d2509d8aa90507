"""The demo's loss curve."""

from __future__ import annotations

import pathlib

import numpy as np


def loss_curve(history, baseline: float, path: pathlib.Path) -> None:
    """Training loss (raw and smoothed), validation loss and the unigram baseline, in nats/byte."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    train = np.asarray(history.train)
    window = max(len(train) // 25, 1)
    smooth = np.convolve(train, np.ones(window) / window, mode="valid")
    ax.plot(history.steps, train, color="tab:blue", alpha=0.25, lw=0.8)
    ax.plot(history.steps[window - 1 :], smooth, color="tab:blue", label="training")
    ax.plot(history.eval_steps, history.validation, "o-", color="tab:orange", label="validation")
    ax.axhline(baseline, color="gray", ls="--", label=f"unigram baseline {baseline:.2f}")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/byte)", title="jaxforge demo: byte-level transformer")
    ax.set_ylim(0, max(float(train[: max(len(train) // 10, 1)].max()), baseline) * 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

"""The ``probe`` predictor: what a network answers on fixed probe inputs, into a tuned learner.

Every model runs through its own checked program on the same ``DEFAULT_PROBES`` (64) fixed probes
of its input's shape (jobs.analysis.probing: N(0, 1) values, or uniform token ids), no weight read.
Its features are the eight summaries of its answers that do not depend on which output is which
(``probing.output_summaries``: softmax entropy, top probability, spread across probes, the share
of the modal answer, ...), then the answers themselves, probe by probe (``n x k`` numbers; models
with fewer outputs than the training models' most common count are padded with NaN, more are
cut). Gradient boosting reads them, its hyperparameters chosen on validation, as every tabular
predictor's (jobs.predictors.tabular). As cheap as StatNN: one forward pass of 64 inputs per model,
each model's answers cached for the process.

Why: vanilla probing is a strong accuracy predictor on zoos of varied architectures (ProbeGen,
Kahana et al., ICLR 2025; an independent baseline on this project's held-out wild CNN zoo was
0.07 ahead of NG-GNN, issue #54): what a network computes is the signal no statistic of its
weights sees. Data-free: the probes are noise, not the zoo's data.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from jobs.analysis.probing import DEFAULT_PROBES, PROBE_SEED, Prober, output_summaries
from jobs.predictors.tabular import TabularPredictor
from jobs.training.data import Selection

SUMMARIES = 8


class Probe(TabularPredictor):
    """Fixed probes' answers and their summaries into gradient boosting (see the module)."""
    name = "probe"
    probes = DEFAULT_PROBES

    def settle(self, con, sel: Selection) -> dict:
        outs, _ = Prober(con, self.probes, PROBE_SEED).outputs(sel.ids("train"))
        widths = [o.shape[1] for o in outs if o is not None]
        width = int(np.bincount(widths).argmax()) if widths else 0
        return {"probes": self.probes, "seed": PROBE_SEED, "width": width}

    def features(self, con, model_ids: Sequence[str], blocks=None) -> tuple[np.ndarray, np.ndarray]:
        n, width = int(self.settings["probes"]), int(self.settings["width"])
        outs, self.unreadable = Prober(con, n, int(self.settings["seed"])).outputs(list(model_ids))
        x = np.full((len(model_ids), SUMMARIES + n * width), np.nan)
        ok = np.array([o is not None for o in outs], bool)
        for i, o in enumerate(outs):
            if o is None:
                continue
            x[i, :SUMMARIES] = output_summaries(o)
            k = min(width, o.shape[1])
            answers = np.full((n, width), np.nan)
            answers[:, :k] = o[:, :k]
            x[i, SUMMARIES:] = answers.reshape(-1)
        return x, ok

    def note(self) -> str:
        return f"{self.settings.get('probes')} fixed probes; " + super().note()


__all__ = ["Probe"]

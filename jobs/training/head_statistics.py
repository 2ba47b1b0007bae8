"""StatNN's features of each model given to a metanetwork's head beside its graph embedding
(``--head-statistics``, issue #31's "statistics into the readout").

The graph embedding is a mean and a max over neurons and edges: a quantile of one layer's weights,
which StatNN reads directly, is hard for message passing to compute. With this lever the head
reads ``[embedding, statistics]``, so the metanetwork starts from what statistics know and learns
what the graph adds. The features are StatNN's (jobs.predictors.tabular.StatNN: per-layer weight
and bias statistics, shape descriptors on mixed zoos), read after the run's symmetry preparation
like the blend's statistics (balanced graphs by default), so they are as invariant as the graph
the metanetwork reads. Each column is mapped to a normal score by its quantiles on the training
models (``KNOTS`` of them, interpolated; robust to the heavy tails of raw weight statistics), a
missing slot reads 0 and gets an indicator column; columns constant on the training models are
dropped. The fitted map is a few numbers per column, saved in the run's manifest as JSON.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

KNOTS = 33
# the normal scores of the knots: quantiles 1/(2K) .. 1 - 1/(2K), so the extremes stay finite (about +-2.5)
SCORES = np.array([NormalDist().inv_cdf((k + 0.5) / KNOTS) for k in range(KNOTS)])


@dataclass
class HeadStatistics:
    """The fitted map from a model's StatNN features to the head's statistics inputs."""
    settings: dict                                 # the StatNN settings features are read with (shape, prepare ...)
    columns: list[int] = field(default_factory=list)    # kept feature columns
    knots: list[list[float]] = field(default_factory=list)   # per kept column, its training quantiles
    missing: list[int] = field(default_factory=list)    # kept columns with missing values: an indicator each

    @property
    def width(self) -> int:
        return len(self.columns) + len(self.missing)

    @classmethod
    def fit(cls, con, sel, prepare: dict | None = None, read: dict | None = None,
            spectral: bool = False) -> tuple["HeadStatistics", np.ndarray]:
        """The map fitted on ``sel``'s training models, and the (n, width) inputs of every selected
        model. ``prepare``: the run's symmetry preparation (jobs.training.preparation). ``read``: a
        feature cache shared with the blend's StatNN (jobs.predictors.tabular.read_once), which
        reads the same features with the same settings: every graph is prepared once. ``spectral``:
        the weight matrices' spectral descriptors (jobs.predictors.spectra) beside the statistics."""
        from jobs.predictors.tabular import FeatureReads, StatNN, read_once, settled

        reader = settled(StatNN(), con, sel, prepare)
        if spectral:
            reader.settings["spectral"] = True
        head = cls(dict(reader.settings))
        x = read_once(FeatureReads(spectral) if read is None else read, reader, con, sel.model_ids)[0]
        train = x[sel.mask("train")]
        finite = np.isfinite(train)
        for c in range(x.shape[1]):
            values = train[finite[:, c], c]
            if len(values) >= 2 and values.max() > values.min():
                head.columns.append(c)
                head.knots.append(np.quantile(values, np.linspace(0.0, 1.0, KNOTS)).tolist())
                if not finite[:, c].all():
                    head.missing.append(c)
        return head, head.transform(x)

    def _reader(self):
        from jobs.predictors.tabular import StatNN

        reader = StatNN()
        reader.settings = dict(self.settings)
        return reader

    def features(self, con, model_ids) -> np.ndarray:
        """The raw StatNN features of catalog models (NaN where a model has no such slot)."""
        return self._reader().features(con, list(model_ids))[0]

    def features_of_graphs(self, con, model_ids, graphs) -> np.ndarray:
        """The raw features of in-memory graphs of ``model_ids`` (e.g. rescaled copies), prepared as
        the catalog models' are."""
        return self._reader().features_of_graphs(con, list(model_ids), graphs)

    def transform(self, x: np.ndarray) -> np.ndarray:
        """(n, width) float32: each kept column's normal score, then the missing indicators."""
        x = np.asarray(x, np.float64)
        out = np.zeros((len(x), self.width), np.float32)
        for j, (c, knots) in enumerate(zip(self.columns, self.knots)):
            v = x[:, c]
            ok = np.isfinite(v)
            out[ok, j] = np.interp(v[ok], knots, SCORES)
        for j, c in enumerate(self.missing):
            out[:, len(self.columns) + j] = ~np.isfinite(x[:, c])
        return out

    def of_models(self, con, model_ids) -> np.ndarray:
        return self.transform(self.features(con, model_ids))

    def of_graphs(self, con, model_ids, graphs) -> np.ndarray:
        return self.transform(self.features_of_graphs(con, model_ids, graphs))

    def to_dict(self) -> dict:
        return {"settings": self.settings, "columns": self.columns, "knots": self.knots, "missing": self.missing}

    @classmethod
    def from_dict(cls, d: dict) -> "HeadStatistics":
        columns, knots = [int(c) for c in d["columns"]], [[float(v) for v in k] for k in d["knots"]]
        missing = [int(c) for c in d.get("missing", [])]
        if len(knots) != len(columns) or any(len(k) != KNOTS for k in knots) or set(missing) - set(columns):
            raise ValueError("a statistics map of another shape")
        return cls(dict(d["settings"]), columns, knots, missing)

"""Learning on neural graphs over the catalog.

- ``jobs.config``: a run's configuration, one dataclass per part; the CLI's options come from it.
- ``jobs.predictors``: the registry of everything that maps a model to a prediction; the tabular
  predictors (StatNN, the flat MLP, ridge), their features, the blend with a metanetwork, peers.
- ``jobs.metanets``: NG-GNN and NG-T and their layers.
- ``jobs.training``: data streaming, tasks and losses, the fit loop (``train``), run records and
  saved weights.
- ``jobs.analysis``: retrieval and probes, alignment and merging, layerwise equivariance, models
  rebuilt from the catalog.
- ``jobs.editing``: metanetworks that edit INRs.
- ``jobs.cli`` (the ``jobs`` command) and ``jobs.demo`` (the end-to-end demo).
"""

import zoocore  # noqa: F401  (selects the DGL backend before DGL is imported)

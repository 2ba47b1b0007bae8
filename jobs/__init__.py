"""NG-GNN models, training, embedding, retrieval and classification over the catalog."""

import zoocore  # noqa: F401  (selects the DGL backend before DGL is imported)

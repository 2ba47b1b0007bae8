"""NG-GNN models, training, embedding, retrieval and classification over the catalog."""

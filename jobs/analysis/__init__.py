"""Analyses of trained networks and runs: retrieval and probes on embeddings, neuron alignment and
merging, layerwise equivariance, and models rebuilt from the catalog."""

"""Neural graphs: trained networks as graphs of neurons (nodes) and weights (edges)."""

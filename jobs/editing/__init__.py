"""Metanetworks that output networks: editing the SIRENs of the ``inr`` zoo (``jobs train-editor``).

- ``targets``: the image transformations (dilation, blur, contrast) that define the edited functions;
- ``siren``: the batched functional forward of an MLP and the exact widening that writes the average
  of K networks as one network (Output Capacity Expansion);
- ``heads``: equivariant per-edge / per-node heads on NG-GNN or NG-T, and the NFN NP baseline, both
  predicting weight and bias changes;
- ``train``: training on function-space MSE, the comparison of methods, writing the edited zoo.
"""

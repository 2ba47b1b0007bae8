"""Model zoos: the on-disk format and the generators of real zoos.

``KINDS`` names the kinds ``pipeline zoo make`` trains (their recipes are ``pipeline.zoo.kinds.RECIPES``,
which imports torch; this list does not, so the CLI can show it)."""

KINDS = {
    "cnn": "CNNs of varied architecture on digits",
    "cnn-fixed": "one CNN architecture on digits, training recipe varied",
    "mlp": "MLPs on four tabular datasets",
    "inr": "SIRENs fitted to digit images",
    "mlp-equivariant": "depth-4 MLPs on flattened digits, autoencoders and classifiers with tanh or GELU first, "
                       "half of them trained with a soft mirror-lr equivariance loss, in a grid of 8 cells "
                       "repeated over seeds, for `jobs layer-equivariance`",
}

CHECKPOINT_FORMATS = ("safetensors", "pt", "pt2")

"""Training a run and what it leaves: configuration parts used by the loop, data streaming, tasks and
losses, the fit loop (train), run records and saved weights."""

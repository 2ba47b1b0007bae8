"""Zoo formats, checkpoint -> neural graph conversion, and ingest into the Parquet catalog."""

import zoocore  # noqa: F401  (selects the DGL backend before DGL is imported)

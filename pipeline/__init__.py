"""Zoo formats, checkpoint -> neural graph conversion, and ingest into the Parquet catalog."""

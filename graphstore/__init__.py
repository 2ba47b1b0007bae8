"""The Parquet catalog, DuckDB views and streaming, and the Cypher metadata stores."""

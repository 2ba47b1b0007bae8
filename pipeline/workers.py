"""The process pool for CPU-bound fan-out (training zoo members, converting checkpoints)."""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor


def process_pool(workers: int) -> ProcessPoolExecutor:
    """Workers started with ``spawn``: a forked child of a process that already ran DuckDB,
    Arrow, Ladybug or a Neo4j driver inherits their threads' state and can crash (seen: a
    segfault in the child's garbage collector when a zoo was made after an ingest)."""
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))

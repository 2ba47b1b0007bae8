"""The bottom layer every package imports: errors, configuration and CLI helpers.

Importing it selects DGL's PyTorch backend before anything imports DGL, so no command prints
DGL's "backend not selected" notice (DGL reads the choice from DGLBACKEND at its import).
"""
import os

os.environ.setdefault("DGLBACKEND", "pytorch")

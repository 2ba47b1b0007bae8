"""Zoos for benchmarks: real zoos from `pipeline zoo make`, grown by perturbed copies."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pipeline.zoo.make import make_zoo

CACHE = Path("/tmp/zoograph-bench")


def base_zoo(kind: str = "cnn", n: int = 60, seed: int = 0) -> Path:
    out = CACHE / f"{kind}-{n}-{seed}"
    if not (out / "metrics.csv").exists():
        make_zoo(kind, out, n=n, seed=seed, workers=2, progress=False)
    return out


def grown_zoo(src: Path, factor: int, seed: int = 0) -> Path:
    """``factor`` copies of every checkpoint of ``src``, weights perturbed by 1e-3 relative noise."""
    out = CACHE / f"{src.name}-x{factor}"
    if (out / ".complete").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    for ckpt in sorted(src.glob("*.safetensors")):
        state = load_file(str(ckpt))
        side = json.loads(ckpt.with_suffix(".json").read_text())
        for k in range(factor):
            noisy = {key: (v + 1e-3 * v.abs().mean() * torch.randn(v.shape, generator=gen)) if v.is_floating_point()
                     else v for key, v in state.items()}
            name = f"{ckpt.stem}-c{k}"
            save_file({key: v.contiguous() for key, v in noisy.items()}, str(out / f"{name}.safetensors"))
            (out / f"{name}.json").write_text(json.dumps(side))
    (out / ".complete").write_text("ok")
    return out


def zoo_folder(kind: str, n: int, seed: int = 0) -> tuple[Path, bool]:
    """The folder of a zoo of ``kind`` with ``n`` models (made once, resumed if cut short), and
    whether this call made any of it."""
    zoo = CACHE / f"{kind}-{n}-{seed}"
    if (zoo / "metrics.csv").exists() and len(list(zoo.glob("*.safetensors"))) >= n:
        return zoo, False
    t = time.perf_counter()
    print(f"making {kind} zoo of {n} models in {zoo} ...", flush=True)
    make_zoo(kind, zoo, n=n, seed=seed, workers=2, progress=True)
    print(f"  made in {time.perf_counter() - t:.0f}s", flush=True)
    return zoo, True


def zoo_catalog(kind: str, n: int, seed: int = 0) -> Path:
    """A catalog holding one zoo of ``kind`` with ``n`` models (made and ingested once, then reused)."""
    from pipeline.ingest import ingest_zoo

    zoo, made = zoo_folder(kind, n, seed)
    cat = CACHE / f"catalog-{kind}-{n}-{seed}"
    if made:
        shutil.rmtree(cat, ignore_errors=True)
    if not (cat / "parts").exists():
        ingest_zoo(zoo, cat, zoo_name=kind, workers=2, progress=False)
    return cat


def mixed_catalog(kinds: list[str], n: int, seed: int = 0) -> Path:
    """A catalog holding one zoo of each of ``kinds`` with ``n`` models each (e.g. a pretraining
    source that covers the edge types of CNNs and of MLPs): each zoo made once, as ``zoo_catalog``
    makes it, and ingested under its kind's name."""
    from pipeline.ingest import ingest_zoo

    if len(kinds) == 1:
        return zoo_catalog(kinds[0], n, seed)
    cat = CACHE / f"catalog-{'+'.join(kinds)}-{n}-{seed}"
    if not (cat / ".complete").exists():
        shutil.rmtree(cat, ignore_errors=True)
        for kind in kinds:
            ingest_zoo(zoo_folder(kind, n, seed)[0], cat, zoo_name=kind, workers=2, progress=False)
        (cat / ".complete").write_text("ok")
    return cat


BLIND = ("wild_cnn", "tabular_mlp", "fixed_cnn")


def blind_catalog(kind: str, n: int, seed: int = 0) -> Path:
    """A catalog holding one blind zoo (benchmarks/blind: generators written without reading this
    project's), made and ingested once, then reused. Checkpoints the converter refuses are left
    out (they are listed in the catalog's ingest_errors)."""
    import importlib
    import sys

    from pipeline.ingest import ingest_zoo

    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    zoo = CACHE / f"blind-{kind}-{n}-{seed}"
    cat = CACHE / f"catalog-blind-{kind}-{n}-{seed}"
    if len(list(zoo.glob("*.pt2"))) < n:
        t = time.perf_counter()
        print(f"making blind {kind} zoo of {n} models in {zoo} ...", flush=True)
        importlib.import_module(f"benchmarks.blind.{kind}").make(zoo, n=n, seed=seed, workers=2)
        print(f"  made in {time.perf_counter() - t:.0f}s", flush=True)
        shutil.rmtree(cat, ignore_errors=True)
    if not (cat / "parts").exists():
        report = ingest_zoo(zoo, cat, zoo_name=kind, workers=2, progress=False)
        if report.errors:
            print(f"  {len(report.errors)} of {n} checkpoints not converted (see ingest_errors)", flush=True)
    return cat

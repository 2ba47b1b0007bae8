"""Output capacity expansion where the paper saw it: INR editing on 28x28 digits (issue #34).

One zoo of SIRENs 2-32-32-1 fitted to digits upsampled to 28x28 (``pipeline zoo make inr --set
side=28``, made once into /tmp/zoograph-bench and reused), one split (``jobs train-editor``'s), and
on it, per seed:

- the identity (the unedited INR) and NFN with NP layers (K = 1; the extra ``peers``);
- NG-GNN and NG-T editors with K = 1, 2, 4, 8 averaged weight sets (Output Capacity Expansion;
  K = 1 is the plain editor), each trained as ``jobs train-editor`` trains its main editor;
- the capacity floor: SIRENs of width 32 K fitted directly to each test INR's target (SIREN
  initialisation, w0 30, Adam 1e-3, ``--floor-steps`` steps): what an edited network of that width
  can reach at best when nothing has to be predicted.

It prints the test MSE of each row (mean over seeds of the mean over test INRs, and the spread over
seeds), its change against the identity, and for K > 1 the paired difference to the same
metanetwork's K = 1 with a bootstrap 95% interval (test INRs resampled, the same draw for both, the
difference averaged over seeds); an interval that holds 0 is no effect. Seconds per row are the
training time of one editor.

Every row of every seed is kept as it finishes (``--results``, default under /tmp/zoograph-bench),
and a rerun with the same zoo, edit and steps reads the rows it finds instead of training them
again: the full table can be filled over several sessions, or by two processes at once (one per
``--models``), and ``--fresh`` starts over.

    .venv/bin/python benchmarks/bench_oce.py              # quick: 300 INRs, 1 seed, NG-GNN K = 1, 4 (~15 min)
    .venv/bin/python benchmarks/bench_oce.py --full       # 1,000 INRs, 3 seeds, NG-GNN and NG-T, K = 1, 2, 4, 8
    # measured: --models ngnn --no-floor and --models ngt --no-floor side by side, 27 and 25 min;
    # then the floor, 27 min; then --full reads every kept row (docs/inr-editing.md)
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from _zoos import CACHE


def inr_catalog(n: int, side: int = 28, seed: int = 0) -> Path:
    """An inr zoo of ``n`` SIRENs at ``side`` x ``side``, made and ingested once."""
    from pipeline.ingest import ingest_zoo
    from pipeline.zoo.make import make_zoo

    zoo, cat = CACHE / f"inr{side}-{n}-{seed}", CACHE / f"catalog-inr{side}-{n}-{seed}"
    if len(list(zoo.glob("*.safetensors"))) < n:
        t = time.perf_counter()
        print(f"making an inr zoo of {n} SIRENs at {side}x{side} in {zoo} ...", flush=True)
        make_zoo("inr", zoo, n=n, seed=seed, workers=2, progress=False, settings={"side": side})
        print(f"  made in {time.perf_counter() - t:.0f}s", flush=True)
        import shutil

        shutil.rmtree(cat, ignore_errors=True)
    if not (cat / "parts").exists():
        ingest_zoo(zoo, cat, zoo_name=f"inr{side}", workers=2, progress=False)
    return cat


def capacity_floor(data, idx: np.ndarray, width: int, steps: int, seed: int = 0, w0: float = 30.0,
                   lr: float = 1e-3) -> np.ndarray:
    """Per INR of ``idx``: the MSE to its target of a SIREN 2-width-width-1 fitted to it directly."""
    from jobs.editing.siren import mlp_forward, pixel_grid

    gen = torch.Generator().manual_seed(seed)
    sizes = (2, width, width, 1)
    params = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        bound = 1.0 / fan_in if i == 0 else math.sqrt(6.0 / fan_in) / w0
        scale = w0 if i == 0 else 1.0
        w = (torch.rand(len(idx), fan_out, fan_in, generator=gen) * 2 - 1) * bound * scale
        b = (torch.rand(len(idx), fan_out, generator=gen) * 2 - 1) * bound * scale
        params.append((w.requires_grad_(), b.requires_grad_()))
    coords = pixel_grid(data.side)
    target = data.targets[idx]
    opt = torch.optim.Adam([t for pair in params for t in pair], lr=lr)
    acts = ("sin", "sin", "identity")
    for _ in range(steps):
        opt.zero_grad()
        loss = ((mlp_forward(params, coords, acts)[..., 0] - target) ** 2).mean(-1)
        loss.sum().backward()
        opt.step()
    with torch.no_grad():
        return ((mlp_forward(params, coords, acts)[..., 0] - target) ** 2).mean(-1).numpy().astype(np.float64)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="1,000 INRs, 3 seeds, NG-GNN and NG-T, K = 1, 2, 4, 8")
    ap.add_argument("--n", type=int, default=None, help="INRs in the zoo (default 300 quick, 1000 full)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds (default 1 quick, 3 full)")
    ap.add_argument("--models", default=None, help="metanetworks (default ngnn quick, ngnn,ngt full)")
    ap.add_argument("--ks", default=None, help="K values, comma-separated (default 1,4 quick, 1,2,4,8 full)")
    ap.add_argument("--edit", default="dilate", help="dilate | blur | contrast (default dilate)")
    ap.add_argument("--steps", type=int, default=400, help="optimiser steps per editor (jobs train-editor's 400)")
    ap.add_argument("--floor-steps", type=int, default=1000, help="steps of the directly fitted SIRENs")
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--results", type=Path, default=None,
                    help="where finished rows are kept and read back (default CACHE/oce-rows-N-EDIT-STEPS)")
    ap.add_argument("--fresh", action="store_true", help="train every row again (the kept rows are replaced)")
    ap.add_argument("--no-floor", action="store_true", help="skip the capacity floor rows")
    args = ap.parse_args(argv)
    from graphstore.catalog import Catalog
    from jobs.config import EditConfig
    from jobs.editing.data import load_edit_data
    from jobs.editing.heads import NFNEditor, nfn_available
    from jobs.editing.train import fit_editor, graph_editor, score
    from jobs.training.compare import paired_bootstrap

    n = args.n or (1000 if args.full else 300)
    seeds = args.seeds or (3 if args.full else 1)
    models = (args.models or ("ngnn,ngt" if args.full else "ngnn")).split(",")
    ks = [int(k) for k in (args.ks or ("1,2,4,8" if args.full else "1,4")).split(",")]
    if 1 not in ks:
        ks = [1, *ks]
    started = time.perf_counter()
    cat = Catalog(inr_catalog(n))
    device = torch.device("cpu")
    rows: dict[str, list[np.ndarray]] = {}
    seconds: dict[str, list[float]] = {}
    kept = args.results or CACHE / f"oce-rows-{n}-{args.edit}-{args.steps}"
    kept.mkdir(parents=True, exist_ok=True)

    def add(name: str, seed: int, run) -> None:
        """The row ``name`` of ``seed``: read back if kept, else ``run()`` -> (mse, seconds), kept."""
        path = kept / f"{name.replace(' ', '_').replace('=', '')}-seed{seed}.npz"
        if path.exists() and not args.fresh:
            with np.load(path) as z:          # arrays written below: no pickle
                mse, secs, how = z["mse"], float(z["seconds"]), "kept"
        else:
            mse, secs = run()
            np.savez(path.with_suffix(".tmp.npz"), mse=mse, seconds=secs)
            path.with_suffix(".tmp.npz").replace(path)
            how = "trained"
        rows.setdefault(name, []).append(mse)
        seconds.setdefault(name, []).append(secs)
        print(f"  {name:14s} seed {seed}: test MSE {mse.mean():.5f} ({secs:.0f}s, {how})", flush=True)

    def timed(fn):
        t = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t

    data = None
    for seed in range(seeds):
        cfg = EditConfig(edit=args.edit, steps=args.steps, seed=seed)
        data = load_edit_data(cat, cfg)
        test = data.index("test")
        if seed == 0:
            counts = {s: int((data.splits == s).sum()) for s in ("train", "val", "test")}
            print(f"{n} INRs at {data.side}x{data.side}, edit {args.edit!r}: {counts}", flush=True)
        add("identity", seed, lambda: (score(None, data, test, device), 0.0))
        if nfn_available() is None:
            def nfn_row():
                torch.manual_seed(seed)
                (nfn, _), secs = timed(lambda: fit_editor(NFNEditor(data.layout.sizes, 1, cfg.nfn_channels), data,
                                                          cfg, device, "nfn", False))
                return score(nfn, data, test, device), secs
            add("nfn", seed, nfn_row)
        for model in models:
            for k in ks:
                def editor_row():
                    torch.manual_seed(seed)
                    mcfg = EditConfig(edit=args.edit, steps=args.steps, seed=seed, model=model, oce=k)
                    (editor, _), secs = timed(lambda: fit_editor(graph_editor(data, mcfg, k), data, mcfg, device,
                                                                 f"{model} K={k}", False))
                    return score(editor, data, test, device), secs
                add(f"{model} K={k}", seed, editor_row)
    test = data.index("test")
    width = data.layout.sizes[1]
    for k in ([] if args.no_floor else ks):
        add(f"floor w={width * k}", 0, lambda: timed(lambda: capacity_floor(data, test, width * k, args.floor_steps)))

    ident = float(np.mean([m.mean() for m in rows["identity"]]))
    print(f"\n{args.edit} on {len(test)} test INRs of {n} at {data.side}x{data.side}; mean ± sd over {seeds} seed(s); "
          "vs K=1: paired difference in mean test MSE, bootstrap 95% interval (* = excludes 0)")
    print(f"{'method':16s}{'test MSE':>20s}{'vs identity':>13s}{'vs K=1':>32s}{'s/editor':>10s}")
    for name, vals in rows.items():
        means = np.array([v.mean() for v in vals])
        vs_k1 = ""
        model, _, k = name.partition(" K=")
        if k and k != "1" and f"{model} K=1" in rows:
            base = rows[f"{model} K=1"]
            d = paired_bootstrap([np.zeros(len(v)) for v in vals], vals, base[:len(vals)], args.resamples,
                                 metric=lambda y, p: float(np.mean(p)))
            rel = 100 * d.mean / float(np.mean([b.mean() for b in base]))
            star = "*" if d.low > 0 or d.high < 0 else " "
            vs_k1 = f"{rel:+6.1f}% [{d.low:+.5f}, {d.high:+.5f}]{star}"
        print(f"{name:16s}{means.mean():>11.5f} ± {means.std():.5f}{100 * (means.mean() - ident) / ident:>+12.1f}%"
              f"{vs_k1:>32s}{np.mean(seconds[name]):>10.0f}")
    default = EditConfig.oce
    for model in models:            # the best K against jobs train-editor's default, paired the same way
        means = {k: float(np.mean([v.mean() for v in rows[f"{model} K={k}"]])) for k in ks if f"{model} K={k}" in rows}
        best = min(means, key=means.get) if means else None
        if best is not None and best != default and default in means:
            vals, base = rows[f"{model} K={best}"], rows[f"{model} K={default}"]
            n = min(len(vals), len(base))
            d = paired_bootstrap([np.zeros(len(v)) for v in vals[:n]], vals[:n], base[:n], args.resamples,
                                 metric=lambda y, p: float(np.mean(p)))
            print(f"{model}: best K={best} vs the default K={default}: {100 * d.mean / means[default]:+.1f}% "
                  f"[{d.low:+.5f}, {d.high:+.5f}]{'*' if d.low > 0 or d.high < 0 else ''}")
        elif best is not None:
            print(f"{model}: the best K is {best}" + (" (jobs train-editor's default)" if best == default else ""))
    print(f"\n{time.perf_counter() - started:.0f}s in all")


if __name__ == "__main__":
    sys.exit(main())

"""The INRs an editor reads, in memory: graphs, original weights, edited targets, splits and the
normalisation of the metanetwork's inputs and outputs; and the run's configuration."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from graphstore import duck
from graphstore.catalog import Catalog
from jobs.config import EditConfig
from jobs.training.data import LayerStats, layer_stats_of_graphs, normalised_graph, select_models
from jobs.editing.siren import MLPLayout, Params
from jobs.editing.targets import target_pixels
from pipeline.neural_graph.build import state_dict_from_graph
from pipeline.neural_graph.graph import NeuralGraph
from pipeline.neural_graph.heterograph import canonical_etypes_of, with_reverses
from pipeline.neural_graph.vocabulary import RELATIONS
from zoocore.errors import JobError

LINEAR = RELATIONS.index("linear")
INHERITED_SKIP = ("index", "zoo_seed", "init_seed", "recipe", "mse", "psnr", "steps", "lr", "optimizer",
                  "width")          # an edit with output capacity expansion is wider than its original


@dataclass
class EditData:
    """The selected INRs in memory: graphs, original weights, targets, splits, normalisation."""

    model_ids: list[str]
    splits: np.ndarray
    image_index: np.ndarray
    graphs: list[NeuralGraph]
    layout: MLPLayout
    params: Params                       # per layer (N, out, in), (N, out): the originals
    targets: torch.Tensor                # (N, P) transformed digits
    stats: LayerStats
    etypes: list
    dgl_graphs: list = field(default_factory=list)
    weight_mean: list[float] = field(default_factory=list)
    weight_scale: list[float] = field(default_factory=list)
    bias_mean: list[float] = field(default_factory=list)
    bias_scale: list[float] = field(default_factory=list)
    inherited: dict[str, dict] = field(default_factory=dict)     # model_id -> attributes an edit keeps
    side: int = 8                        # the pixel grid is side x side

    def index(self, split: str) -> np.ndarray:
        return np.nonzero(self.splits == split)[0]

    @classmethod
    def from_graphs(cls, model_ids: Sequence[str], graphs: Sequence[NeuralGraph], splits: Sequence[str],
                    image_index: Sequence[int], edit: str, stats: LayerStats | None = None,
                    etypes: list | None = None, side: int = 8) -> "EditData":
        """Build from neural graphs; ``stats`` (default: from the training split) normalise the
        metanetwork's inputs and scale its outputs. The originals are rebuilt with the exact inverse."""
        graphs = list(graphs)
        layout = MLPLayout.of_graph(graphs[0])
        for mid, g in zip(model_ids, graphs):
            if MLPLayout.of_graph(g) != layout:
                raise JobError(f"model {mid} has another architecture than {model_ids[0]}: one editor edits one "
                               "architecture (select the models with --where)")
        splits = np.asarray(splits)
        if stats is None:
            train = [g for g, s in zip(graphs, splits) if s == "train"]
            if not train:
                raise JobError("no training models to compute the normalisation from")
            stats = layer_stats_of_graphs(train)
        if etypes is None:
            etypes = with_reverses(set().union(*(canonical_etypes_of(g.node_type, g.src, g.dst, g.relation)
                                                 for g in graphs)))
        params = layout.stack([state_dict_from_graph(g) for g in graphs])
        data = cls(list(model_ids), splits, np.asarray(image_index, dtype=np.int64), graphs, layout, params,
                   torch.from_numpy(target_pixels(image_index, edit, side)), stats, etypes, side=side)
        data.dgl_graphs = [normalised_graph(g, stats, (1, 1), etypes, model_id=m) for m, g in zip(model_ids, graphs)]
        for li in range(layout.num_layers):
            wm, ws = stats.weight(np.array([li]), np.array([LINEAR]))
            bm, bs = stats.bias(np.array([li + 1]))
            data.weight_mean.append(float(wm[0]))
            data.weight_scale.append(float(ws[0]))
            data.bias_mean.append(float(bm[0]))
            data.bias_scale.append(float(bs[0]))
        return data


def load_edit_data(catalog: Catalog, cfg: EditConfig) -> EditData:
    """The catalog's INRs selected by ``cfg.where`` that have an ``image_index`` and are not edits."""
    from pipeline.graph_codec import ids_table, read_graphs, read_plans

    con = duck.connect(catalog)
    try:
        cols = {r[0] for r in con.execute("DESCRIBE models").fetchall()}
        if "image_index" not in cols:
            raise JobError("the catalog has no INRs (no models column image_index): make and ingest an inr zoo, "
                           "e.g. `pipeline zoo make inr inr-zoo --n 300 && pipeline ingest inr-zoo`")
        conds = [f"({cfg.where})"] if cfg.where else []
        if "edited_from" in cols:
            conds.append("edited_from IS NULL")
        sel = select_models(con, "image_index", " AND ".join(conds) or None, task="regression", catalog=catalog)
        archs = sorted(set(sel.architectures))
        if len(archs) > 1:
            raise JobError(f"the selected INRs have {len(archs)} architectures; one editor edits one architecture "
                           "(narrow --where)")
        # one read of the selection's metadata: what an edit inherits, and the grid side (a typed column of
        # INRs of upsampled digits, pipeline zoo make inr --set side=28; missing: 8x8)
        cur = con.cursor()
        ids_table(cur, sel.model_ids)
        rows = cur.execute("SELECT model_id, metadata_json, " + ("side" if "side" in cols else "NULL") +
                           " FROM models JOIN _ids USING (model_id)").fetchall()
        cur.close()
        inherited = {m: _inherited(json.loads(j or "{}")) for m, j, _ in rows}
        sides = sorted({8 if s is None else int(s) for _, _, s in rows})
        if len(sides) > 1:
            raise JobError(f"the selected INRs are fitted on grids of {', '.join(map(str, sides))} pixels a side; "
                           "one editor edits one grid (narrow --where, e.g. --where 'side = 28')")
        side = sides[0] if sides else 8
        arch, plans = read_plans(con, sel.model_ids)
        graphs = read_graphs(con, sel.model_ids, plans=plans)
    finally:
        con.close()
    counts = {s: int((sel.splits == s).sum()) for s in ("train", "val", "test")}
    if counts["train"] < 2 or counts["val"] < 1 or counts["test"] < 1:
        raise JobError(f"too few INRs to train, validate and test an editor: {counts}")
    data = EditData.from_graphs(sel.model_ids, graphs, sel.splits, sel.targets.astype(np.int64), cfg.edit,
                                side=side)
    data.inherited = inherited
    return data


def _inherited(metadata: dict) -> dict:
    """The attributes of an original INR its edit keeps (label, dataset, w0; not its own fit)."""
    return {k: v for k, v in metadata.items() if k not in INHERITED_SKIP and not isinstance(v, (dict, list))}

"""Analytics over a run's embeddings: similar-model retrieval and linear classification probes.

Embeddings are read from the ``embeddings`` relation (the run's own and those of its ``predict``
runs); similarity is cosine, computed as one matrix product in numpy.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from graphstore import duck
from graphstore.catalog import Catalog
from graphstore.schema import SIMILAR
from jobs.training.data import hash_split
from zoocore.errors import JobError
from zoocore.names import check_name

RUN_EMBEDDINGS = (
    "SELECT model_id, arg_max(vector, run_id) AS vector FROM embeddings "
    "WHERE run_id = ? OR starts_with(run_id, ? || '-predict-') GROUP BY model_id ORDER BY model_id")
LATEST_RUN_WITH = (
    "SELECT r.run_id FROM runs r JOIN embeddings e ON e.run_id = r.run_id WHERE e.model_id = ? "
    "AND r.run_id NOT LIKE '%-predict-%' ORDER BY r.created_at DESC LIMIT 1")


def _catalog(catalog) -> Catalog:
    return (catalog if isinstance(catalog, Catalog) else Catalog(catalog)).require()


def load_embeddings(con, run_id: str) -> tuple[list[str], np.ndarray]:
    check_name(run_id, "run id")
    rows = con.execute(RUN_EMBEDDINGS, [run_id, run_id]).fetchall()
    if not rows:
        raise JobError(f"run {run_id!r} has no embeddings in the catalog")
    return [r[0] for r in rows], np.array([r[1] for r in rows], dtype=np.float64)


def cosine_neighbours(emb: np.ndarray, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices and cosine similarities of the ``k`` nearest rows of ``emb`` to each query row.

    Shapes: emb (N, D), query (Q, D) -> (Q, k), (Q, k).
    """
    a = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    q = query / np.maximum(np.linalg.norm(query, axis=1, keepdims=True), 1e-12)
    sims = q @ a.T
    k = min(k, emb.shape[0])
    idx = np.argpartition(-sims, k - 1, axis=1)[:, :k]
    part = np.take_along_axis(sims, idx, axis=1)
    order = np.argsort(-part, axis=1, kind="stable")
    return np.take_along_axis(idx, order, 1), np.take_along_axis(part, order, 1)


def precision_at_k(emb: np.ndarray, labels: np.ndarray, k: int) -> float:
    """Mean share of each model's k nearest others that carry its label."""
    idx, _ = cosine_neighbours(emb, emb, k + 1)
    idx = idx[:, 1:]                                   # drop self (similarity 1)
    return float((labels[idx] == labels[:, None]).mean())


@dataclass
class RetrievalResult:
    run_id: str
    query: str
    columns: list[str]
    rows: list[list]
    warning: str | None = None


def retrieve(catalog, model_id: str, k: int = 10, run_id: str | None = None, store=None) -> RetrievalResult:
    """The ``k`` models most similar to ``model_id`` (cosine of embeddings); with ``store``,
    also write SIMILAR_TO edges there and to the catalog's ``similarities`` relation."""
    catalog = _catalog(catalog)
    con = duck.connect(catalog)
    if run_id is None:
        row = con.execute(LATEST_RUN_WITH, [model_id]).fetchone()
        if row is None:
            raise JobError(f"no run has an embedding of model {model_id!r} (train or `jobs predict` first)")
        run_id = row[0]
    ids, emb = load_embeddings(con, run_id)
    if model_id not in ids:
        raise JobError(f"run {run_id!r} has no embedding of model {model_id!r}")
    q = ids.index(model_id)
    idx, sims = cosine_neighbours(emb, emb[q:q + 1], k + 1)
    hits = [(ids[i], float(s)) for i, s in zip(idx[0], sims[0]) if i != q][:k]
    con.register("_hits", pa.table({"model_id": [h[0] for h in hits], "similarity": [h[1] for h in hits],
                                    "rank": list(range(1, len(hits) + 1))}))
    rows = con.execute("SELECT h.rank, h.model_id, round(h.similarity, 4) AS similarity, m.checkpoint, "
                       "m.test_accuracy, m.dataset, a.summary FROM _hits h JOIN models m USING (model_id) "
                       "JOIN architectures a USING (architecture_id) ORDER BY h.rank").fetchall()
    con.close()
    warning = None
    if store is not None:
        store.write_similar([(model_id, m, s) for m, s in hits], run_id)
        found = store.run("MATCH (m:Model {model_id: $id}) RETURN count(m) AS n", {"id": model_id}).rows
        if not found or not found[0][0]:
            warning = (f"model {model_id} is not in the graph store {store.describe()}: no SIMILAR_TO edge "
                       "was made there (run `graphstore sync`); the catalog keeps them")
        table = pa.table({"run_id": [run_id] * len(hits), "query_id": [model_id] * len(hits),
                          "neighbour_id": [h[0] for h in hits], "rank": list(range(1, len(hits) + 1)),
                          "score": [h[1] for h in hits]}, schema=SIMILAR)
        catalog.commit_results(run_id + "-similar", {"similarities": table})
    return RetrievalResult(run_id, model_id, ["rank", "model_id", "similarity", "checkpoint", "test_accuracy",
                                              "dataset", "architecture"], [list(r) for r in rows], warning)


@dataclass
class ProbeResult:
    run_id: str
    target: str
    accuracy: float
    macro_f1: float
    classes: list[str]
    confusion: np.ndarray
    n_train: int
    n_test: int
    png: Path | None

    def summary(self) -> str:
        width = max(len(c) for c in self.classes) + 2
        lines = [f"linear probe on run {self.run_id} embeddings -> {self.target!r}: accuracy {self.accuracy:.4f}, "
                 f"macro-F1 {self.macro_f1:.4f} ({self.n_train} train / {self.n_test} test models)",
                 "confusion (rows true, columns predicted):", " " * width + "".join(c[:8].rjust(9) for c in self.classes)]
        for c, row in zip(self.classes, self.confusion):
            lines.append(c.ljust(width) + "".join(f"{v:9d}" for v in row))
        if self.png:
            lines.append(f"saved {self.png}")
        return "\n".join(lines)


def classify(catalog, run_id: str, target: str, out_png: str | Path | None = None, seed: int = 0) -> ProbeResult:
    """A logistic-regression probe on frozen embeddings for any categorical models column,
    trained on the train+val split and scored on the test split (same hash split as training)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    catalog = _catalog(catalog)
    con = duck.connect(catalog)
    cols = {r[0] for r in con.execute("DESCRIBE models").fetchall()}
    if target not in cols:
        raise JobError(f"models has no column {target!r}")
    ids, emb = load_embeddings(con, run_id)
    labels = dict(con.execute(f'SELECT model_id, CAST("{target}" AS VARCHAR) FROM models '
                              f'WHERE "{target}" IS NOT NULL').fetchall())
    con.close()
    keep = [i for i, m in enumerate(ids) if m in labels]
    if len(keep) < 4:
        raise JobError(f"only {len(keep)} models of run {run_id!r} have {target!r}")
    y = np.array([labels[ids[i]] for i in keep])
    x = emb[keep]
    test = np.array([hash_split(ids[i]) == "test" for i in keep])
    if test.sum() == 0 or (~test).sum() == 0 or len(set(y[~test])) < 2:
        raise JobError("the split leaves no test models or a single training class")
    probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, random_state=seed))
    probe.fit(x[~test], y[~test])
    pred = probe.predict(x[test])
    classes = sorted(set(y))
    cm = confusion_matrix(y[test], pred, labels=classes)
    png = None
    if out_png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(1.2 + 0.6 * len(classes), 1.0 + 0.6 * len(classes)))
        ax.imshow(cm, cmap="Blues")
        ax.set_xticks(range(len(classes)), classes, rotation=45, ha="right")
        ax.set_yticks(range(len(classes)), classes)
        for (i, j), v in np.ndenumerate(cm):
            ax.text(j, i, str(v), ha="center", va="center")
        ax.set_xlabel("predicted")
        ax.set_ylabel("true")
        ax.set_title(f"{target}: accuracy {accuracy_score(y[test], pred):.2f}")
        fig.tight_layout()
        png = Path(out_png)
        fig.savefig(png, dpi=100)
        plt.close(fig)
    return ProbeResult(run_id, target, float(accuracy_score(y[test], pred)),
                       float(f1_score(y[test], pred, average="macro")), classes, cm, int((~test).sum()),
                       int(test.sum()), png)

"""Shared check: ``jobs predict`` on a run's own models gives back the run's predictions."""
from __future__ import annotations

from graphstore import duck
from jobs.training.predict import predict


def predict_again_gap(catalog, run_id: str, where: str, method: str = "ngnn") -> float:
    """The largest gap between run ``run_id``'s ``method`` predictions and what ``jobs predict``
    gives for the models matching ``where`` (asserting it predicted every one of them)."""
    con = duck.connect(catalog)
    mine = dict(con.execute("SELECT model_id, predicted FROM predictions WHERE run_id = ? AND method = ?",
                            [run_id, method]).fetchall())
    con.close()
    assert predict(catalog, run_id, where=where).n == len(mine) > 0
    con = duck.connect(catalog)
    again = dict(con.execute("SELECT model_id, predicted FROM predictions WHERE starts_with(run_id, ?) "
                             "AND method = ?", [run_id + "-predict-", method]).fetchall())
    con.close()
    return max(abs(again[m] - v) for m, v in mine.items())

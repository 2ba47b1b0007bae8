"""A metanetwork and its partners in one prediction: ``w * metanetwork + (1 - w) * statistics``,
where *statistics* is the mean of the registry's blend partners (jobs.predictors entries with
``stack=True``: StatNN's two learners, ``statnn_spectral``, and the probing predictors ``probe``
and ``probegen``, which read what each network computes) and ``w`` in 0, 0.1, ..., 1 is chosen on
the validation split. The third partner joined after the development zoos' folds, re-scored
offline, gained +0.002 to +0.010 with it in 8 of 9 (docs/metanetworks.md).

Why: on zoos this project did not make, a metanetwork alone can lose to statistics (issue #31); a
blend chosen on validation leans on whichever carries the signal. The partner is the mean of
StatNN's learners, not the one that scores best on validation: on the development zoos (quick
mode, 3 folds, 60 validation models) validation picked the weaker learner in 4 of 6 folds, while
the mean was at least as good as the better one (cnn 0.545 vs 0.526, cnn-fixed 0.574 vs 0.571) and
its blend kept within 0.005 of NG-GNN where NG-GNN was ahead (docs/accuracy.md). One exception:
a learner that has collapsed is left out of the mean. A partner whose validation score is more
than ``COLLAPSED`` below the best partner's is dropped: where the learners are level (every
development fold) that never happens, and where one learner fails outright (StatNN's MLP on some
zoos written by other code) the mean would carry its failure into the answer. The threshold was 0.1
until the wild zoo of seed 3 (development) showed plain StatNN 0.13 behind StatNN with spectral
descriptors at 250 training models, kept in the mean at 0.1: re-scored offline on the development
folds, 0.05 moved the answer +0.017 [+0.012, +0.023] there and left the fixed zoo's 500-model folds
unchanged (docs/metanetworks.md). All inputs are on
the target's scale (the metanetwork calibrated, StatNN clipped to the training range), so the
blend is too. Regression only: a class is not a number.

Plain where trusted (``TrainConfig.plain_statistics``, the default). A run whose metanetwork reads
balanced graphs (predictions unchanged when a network is rewritten with other neuron scales) has two
blends: one with statistics of the checkpoints' own weights, and a *fallback* with statistics of the
balanced graphs. An input whose own weight scales lie within the training models' (the *gate*: a
jobs.training.trust.TrustProfile of the plain graphs) gets the first; any other input, e.g. a copy
rescaled by a conversion tool, gets the fallback, which is as invariant as the metanetwork. Why: the
weights' own scales carry training-process signal that balancing removes (on the wild CNN zoo of
seed 2, 0.017 of tau at 100 training models and 0.015 at 500), and a rescaled copy is exactly what
the gate flags (docs/metanetworks.md).

Residual (``TrainConfig.residual``): the metanetwork is trained on the targets minus the statistics
(``statistics_base``: out-of-fold on the training models), so that it learns only what statistics
miss; its prediction is then added to the statistics, and the blend is ``statistics + w * residual``
(the same family of blends: ``w * (statistics + residual) + (1 - w) * statistics``).

Recalibrated (``CALIBRATION``, ``"affine"`` by default): the blend's own least-squares line
``a * blend + b`` to the validation targets (slope > 0, so every ranking is unchanged), its answers
clipped to the training targets' range, like StatNN's. Why: a mean of predictors is narrower than
the targets, and a weight chosen for tau says nothing of scale. On the development zoos (seed 3,
re-scored offline) it lowered the test MAE in all 5 groups of folds (4 with the interval below zero,
-0.002 at the fixed CNN's 100 and the wild CNNs' 250 training models) and left R^2 within its noise;
tau is unchanged wherever the answer stays inside the training range (docs/metanetworks.md).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from jobs.training.tasks import Task, increasing_line
from jobs.training.trust import TrustProfile

WEIGHTS = np.round(np.linspace(0.0, 1.0, 11), 2)
COLLAPSED = 0.05         # validation score (Kendall tau for regression) this far below the best partner's: dropped
WEIGHT_RULE = "select"   # how the blend reads validation: one of WEIGHT_RULES
WEIGHT_RULES = ("select", "grid", "bagged", "even")
SELECTION_STEPS = 10     # greedy steps of ensemble selection (the "select" rule): shares are multiples of 1/10
BAGS = 100               # bootstrap resamples of the "bagged" rule
CALIBRATION = "affine"   # the blend recalibrated on validation: one of CALIBRATIONS
CALIBRATIONS = ("affine", "none")
STACK_FORMAT = "zoograph.stack/1"


def choose_weight(task: Task, y: np.ndarray, metanet: np.ndarray, statistics: np.ndarray) -> float:
    """The metanetwork's weight by ``WEIGHT_RULE``: ``"grid"``, the best on validation
    (``best_weight``); ``"bagged"``, the mean of the best on ``BAGS`` bootstrap resamples of the
    validation models (drawn with a fixed seed), rounded to 0.01; ``"even"``, 0.5."""
    if WEIGHT_RULE == "even":
        return 0.5
    if WEIGHT_RULE == "bagged":
        rng = np.random.default_rng(0)
        picks = [best_weight(task, y[i], metanet[i], statistics[i])
                 for i in (rng.integers(0, len(y), len(y)) for _ in range(BAGS))]
        return float(np.round(np.mean(picks), 2))
    if WEIGHT_RULE not in ("grid", "select"):      # "select" weighs a residual run's blend by the grid
        raise ValueError(f"unknown weight rule {WEIGHT_RULE!r}; rules: {', '.join(WEIGHT_RULES)}")
    return best_weight(task, y, metanet, statistics)


def ensemble_selection(task: Task, y: np.ndarray, predictions: dict[str, np.ndarray],
                       steps: int = SELECTION_STEPS) -> dict[str, float]:
    """Ensemble selection (Caruana et al., ICML 2004): ``steps`` times, add (with replacement) the
    member whose addition gives the mean with the best validation score; each member's share is how
    often it was added. Its first step is the best single member on validation, and a member is
    added again only where that helps, so a strong member is never averaged away by weaker ones.
    Ties go to the first member in order."""
    names = list(predictions)
    counts = dict.fromkeys(names, 0)
    total = None
    for k in range(steps):
        best = None
        for n in names:
            cand = predictions[n] if total is None else (total + predictions[n]) / (k + 1)
            s = task.score(task.metrics(y, cand))
            s = s if np.isfinite(s) else -np.inf
            if best is None or s > best[0] + 1e-12:
                best = (s, n)
        counts[best[1]] += 1
        total = predictions[best[1]] if total is None else total + predictions[best[1]]
    return {n: c / steps for n, c in counts.items()}


def best_weight(task: Task, y: np.ndarray, metanet: np.ndarray, statistics: np.ndarray) -> float:
    """The weight in ``WEIGHTS`` with the best score of ``y``; on a tie the one nearest 0.5, the
    even blend."""
    scores = [task.score(task.metrics(y, blend(metanet, statistics, w))) for w in WEIGHTS]
    scores = np.nan_to_num(np.asarray(scores, float), nan=-np.inf)
    best = np.flatnonzero(scores >= scores.max() - 1e-12)
    return float(WEIGHTS[best[np.argmin(np.abs(WEIGHTS[best] - 0.5))]])


def healthy(task: Task, y: np.ndarray, predictions: dict[str, np.ndarray]) -> list[str]:
    """The partners (by name, in order) whose validation score is within ``COLLAPSED`` of the
    best partner's."""
    scores = {n: task.score(task.metrics(y, p)) for n, p in predictions.items()}
    scores = {n: (s if np.isfinite(s) else -np.inf) for n, s in scores.items()}
    best = max(scores.values())
    return [n for n, s in scores.items() if s >= best - COLLAPSED] or list(predictions)


@dataclass(frozen=True)
class Line:
    """``clip(slope * x + intercept, low, high)``: a blend's recalibration (identity by default)."""
    slope: float = 1.0
    intercept: float = 0.0
    low: float = -np.inf
    high: float = np.inf

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.clip(self.slope * np.asarray(x, float) + self.intercept, self.low, self.high)

    def to_dict(self) -> dict:
        return {"slope": self.slope, "intercept": self.intercept,
                "low": None if np.isinf(self.low) else self.low, "high": None if np.isinf(self.high) else self.high}

    @classmethod
    def from_dict(cls, doc: dict | None) -> "Line":
        if doc is None:                           # runs saved before the blend was recalibrated
            return cls()
        low, high = doc.get("low"), doc.get("high")
        line = cls(float(doc["slope"]), float(doc["intercept"]), -np.inf if low is None else float(low),
                   np.inf if high is None else float(high))
        if not (np.isfinite(line.slope) and line.slope > 0 and np.isfinite(line.intercept) and line.low <= line.high):
            raise ValueError(f"a recalibration line needs a finite slope > 0 and low <= high; got {doc}")
        return line


def fit_line(y: np.ndarray, p: np.ndarray, bounds: tuple[float, float]) -> Line:
    """``CALIBRATION``'s line from blend ``p`` to targets ``y`` (validation), clipped to ``bounds``:
    the metanetwork's own calibration line (jobs.training.tasks.increasing_line); the identity with
    ``"none"`` or where that gives none (too few known pairs, constant predictions, a slope that is
    not positive)."""
    if CALIBRATION not in CALIBRATIONS:
        raise ValueError(f"unknown calibration {CALIBRATION!r}; calibrations: {', '.join(CALIBRATIONS)}")
    y, p = np.asarray(y, float), np.asarray(p, float)
    ok = ~np.isnan(y) & np.isfinite(p)
    fit = None if CALIBRATION == "none" else increasing_line(p[ok], y[ok])
    return Line() if fit is None else Line(*fit, *map(float, bounds))


def partners_part(partners: list[np.ndarray], shares: list[float] | None) -> np.ndarray:
    """The partners' predictions averaged: plainly, or weighted by ``shares`` (ensemble selection)."""
    if shares is None:
        return np.mean(partners, axis=0)
    return np.sum([s * np.asarray(p, float) for s, p in zip(shares, partners)], axis=0)


def blend(metanet: np.ndarray, statistics: np.ndarray, weight: float) -> np.ndarray:
    return weight * np.asarray(metanet, float) + (1.0 - weight) * np.asarray(statistics, float)


@dataclass
class Stack:
    """A fitted blend: the metanetwork's weight and the statistics predictors it is blended with."""
    metanetwork: str
    partners: list[str]                    # tabular predictors' names (jobs.predictors) in the mean
    weight: float
    predictors: list = field(default_factory=list)     # the fitted partners (jobs.predictors.tabular), in that order
    predictions: np.ndarray | None = None
    candidates: list[str] = field(default_factory=list)   # the partners considered (the name); default: partners
    fallback: "Stack | None" = None        # the blend with statistics of the run's balanced graphs, for inputs outside `gate`
    gate: TrustProfile | None = None       # the training models' own weight scales (read without preparation)
    residual: bool = False                 # the metanetwork predicts the targets minus the statistics
    line: Line = field(default_factory=Line)   # the blend's recalibration on validation
    shares: list[float] | None = None      # each partner's share of the partners' part (sums to 1); None: the mean

    @property
    def name(self) -> str:
        """The answer's method name: the metanetwork and every partner considered, whichever were
        kept, so that a recipe's answer has one name on every zoo and fold."""
        return "+".join([self.metanetwork, *(self.candidates or self.partners)])

    def statistics(self, partners: list[np.ndarray]) -> np.ndarray:
        """The partners' part: their mean, or their mean weighted by ``shares``."""
        return partners_part(partners, self.shares)

    @property
    def note(self) -> str:
        prepared = sorted({k for p in self.predictors
                           for k, v in (getattr(p, "settings", {}).get("prepare") or {}).items() if v})
        if self.shares is not None:
            parts = [f"{self.weight:g} x {self.metanetwork}"] if self.weight else []
            parts += [f"{(1 - self.weight) * s:.2g} x {n}" for n, s in zip(self.partners, self.shares)]
            text = " + ".join(parts) + ", chosen on val by ensemble selection"
            text += f" (statistics of {', '.join(prepared)} graphs)" if prepared else ""
        else:
            if self.residual:
                text = (f"mean({', '.join(self.partners)}) + {self.weight:g} x {self.metanetwork} trained on its "
                        "residual, w chosen on val")
            else:
                text = (f"{self.weight:g} x {self.metanetwork} + {1 - self.weight:g} x mean({', '.join(self.partners)}"
                        + (f" of {', '.join(prepared)} graphs" if prepared else "") + "), w chosen on val")
            dropped = [c for c in self.candidates if c not in self.partners]
            text += f"; {', '.join(dropped)} left out (collapsed on val)" if dropped else ""
        if self.line != Line():
            sign = "-" if self.line.intercept < 0 else "+"
            text += f"; recalibrated on val ({self.line.slope:.3g} x {sign} {abs(self.line.intercept):.3g})"
        if self.fallback is None:
            return text
        return f"{text}; outside the training models' weight scales: {self.fallback.note}"

    def apply(self, metanet: np.ndarray, partners: list[np.ndarray], trusted: np.ndarray | None = None,
              fallback: list[np.ndarray] | None = None) -> np.ndarray:
        """The blend where every partner has an answer, the metanetwork alone elsewhere (a residual
        metanetwork: NaN there); with a fallback, its blend (of ``fallback``, its partners'
        predictions) where ``trusted`` is False."""
        statistics = self.statistics(partners)
        if self.residual:
            metanet = statistics + np.asarray(metanet, float)
        out = np.where(np.isfinite(statistics), self.line(blend(metanet, statistics, self.weight)), metanet)
        if self.fallback is None:
            return out
        return np.where(trusted, out, self.fallback.apply(metanet, fallback))

    def predict(self, con, model_ids, metanet: np.ndarray) -> dict[str, np.ndarray]:
        """The blend and each partner's predictions for ``model_ids``, given the metanetwork's."""
        from jobs.predictors.tabular import predict_all

        parts = dict(zip(self.partners, predict_all(con, self.predictors, model_ids)))
        trusted = fallback = None
        if self.fallback is not None:
            trusted = self.gate.judge_catalog(con, model_ids)
            fallback = predict_all(con, self.fallback.predictors, model_ids)
        out = {self.name: self.apply(metanet, list(parts.values()), trusted, fallback), **parts}
        if self.residual:
            out[self.metanetwork] = self.residual_row(metanet, list(parts.values()))
        return out

    @staticmethod
    def residual_row(metanet: np.ndarray, partners: list[np.ndarray]) -> np.ndarray:
        """A residual metanetwork's own row: its prediction on top of the mean of its partners' (the
        statistics it was trained against)."""
        return np.mean(partners, axis=0) + np.asarray(metanet, float)

    def predict_graphs(self, con, model_ids, graphs, metanet: np.ndarray) -> np.ndarray:
        """The blend for in-memory graphs of ``model_ids`` (e.g. rescaled copies), given the
        metanetwork's predictions for them."""
        def parts(predictors):
            return [p.predict_features(p.features_of_graphs(con, model_ids, graphs)) for p in predictors]

        if self.fallback is None:
            return self.apply(metanet, parts(self.predictors))
        return self.apply(metanet, parts(self.predictors), self.gate.judge_graphs(con, model_ids, graphs),
                          parts(self.fallback.predictors))

    def files(self) -> dict[str, bytes]:
        """``stack.json`` and each partner's files (jobs.training.run_weights.predictor_files)."""
        from jobs.training.run_weights import predictor_files

        doc = {"format": STACK_FORMAT, "metanetwork": self.metanetwork, "partners": self.partners,
               "weight": self.weight, "candidates": self.candidates or self.partners, "residual": self.residual,
               "line": self.line.to_dict(), "shares": self.shares}
        files = {}
        for name, p in zip(self.partners, self.predictors):
            files.update(predictor_files(f"stack-{name}", p))
        if self.fallback is not None:
            doc["fallback"] = {"partners": self.fallback.partners, "weight": self.fallback.weight,
                               "candidates": self.fallback.candidates or self.fallback.partners,
                               "line": self.fallback.line.to_dict(), "shares": self.fallback.shares}
            doc["gate"] = self.gate.to_dict()
            for name, p in zip(self.fallback.partners, self.fallback.predictors):
                files.update(predictor_files(f"stack-fallback-{name}", p))
        return {"stack.json": json.dumps(doc).encode(), **files}


def blend_partners(task: Task, sel, fitted: dict, residual: bool = False) -> tuple[list[str], list[str]]:
    """(the blend partners of ``fitted`` that read every selected model, those of them a blend
    keeps: not collapsed on validation); nothing for a class target or without a validation split.
    ``residual``: only partners with out-of-fold predictions (what a residual metanetwork is trained
    against: the tabular ones)."""
    from jobs.predictors import entry

    val = sel.mask("val")
    candidates = [n for n, (p, r) in fitted.items() if entry(n).stack and r.applicable.all()
                  and (not residual or hasattr(p, "out_of_fold"))]
    if not task.numeric or val.sum() < 2 or not candidates:
        return [], []
    return candidates, healthy(task, sel.targets[val], {n: fitted[n][1].predictions[val] for n in candidates})


def statistics_base(task: Task, sel, fitted: dict, features) -> np.ndarray | None:
    """What a residual metanetwork is trained against: the mean of the blend's statistics for every
    selected model, each training model's from learners fitted without it (``out_of_fold``), or None
    where a run would not blend. ``features(predictor)``: the features it was fitted on."""
    _, partners = blend_partners(task, sel, fitted, residual=True)
    if not partners:
        return None
    return np.mean([fitted[n][0].out_of_fold(*features(fitted[n][0]), sel) for n in partners], axis=0)


def stack_with_statistics(task: Task, sel, name: str, metanet: np.ndarray, fitted: dict,
                          fallback: dict | None = None, gate: TrustProfile | None = None,
                          trusted: np.ndarray | None = None, residual: bool = False) -> Stack | None:
    """The metanetwork ``name``'s predictions ``metanet`` blended with the mean of the fitted
    statistics predictors (``fitted``: jobs.predictors.tabular.fit_all); None for a class target, without a
    validation split, or when no statistics predictor reads every selected model. With ``fallback``
    (statistics of the run's balanced graphs, fitted likewise), ``gate`` and ``trusted`` (the gate's
    judgement of each selected model): a second blend of those, chosen on validation apart, for the
    models outside the gate. ``residual``: ``metanet`` predicts the targets minus the statistics."""
    val = sel.mask("val")
    candidates, partners = blend_partners(task, sel, fitted, residual)
    if not partners:
        return None
    shares = None
    if WEIGHT_RULE == "select" and not residual:     # the metanetwork and every candidate, weighted on val
        chosen = ensemble_selection(task, sel.targets[val], {name: metanet[val], **{
            n: fitted[n][1].predictions[val] for n in candidates}})
        weight = chosen.pop(name)
        kept = [n for n in candidates if chosen[n] > 0]
        if not kept:                  # the metanetwork alone: the best partner on validation, at weight 0
            kept = [max(candidates, key=lambda n: task.score(task.metrics(sel.targets[val],
                                                                            fitted[n][1].predictions[val])))]
            chosen[kept[0]] = 1.0
        partners = kept
        total = sum(chosen[n] for n in partners)
        shares = [chosen[n] / total for n in partners]
    parts = [fitted[n][1].predictions for n in partners]
    statistics = partners_part(parts, shares)
    full = statistics + metanet if residual else metanet
    if shares is None:
        weight = choose_weight(task, sel.targets[val], full[val], statistics[val])
    train = sel.targets[sel.mask("train")].astype(float)
    train = train[np.isfinite(train)]
    bounds = (float(train.min()), float(train.max())) if len(train) else (-np.inf, np.inf)
    line = fit_line(sel.targets[val], blend(full[val], statistics[val], weight), bounds)
    stack = Stack(name, partners, weight, [fitted[n][0] for n in partners], candidates=candidates,
                  residual=residual, line=line, shares=shares)
    if fallback is None:
        stack.predictions = stack.apply(metanet, parts)
        return stack
    stack.fallback = stack_with_statistics(task, sel, name, metanet, fallback, residual=residual)
    if stack.fallback is None:
        raise ValueError("the fallback statistics do not read every selected model")
    stack.gate = gate
    stack.predictions = stack.apply(metanet, parts, trusted, [fallback[n][1].predictions for n in stack.fallback.partners])
    return stack


def _shares(raw, n: int) -> list[float] | None:
    """A saved blend's partner shares (runs saved before ensemble selection have none: the mean)."""
    if raw is None:
        return None
    shares = [float(s) for s in raw]
    if len(shares) != n or any(not np.isfinite(s) or s < 0 for s in shares) or abs(sum(shares) - 1) > 1e-6:
        raise ValueError(f"partner shares {raw!r} do not fit {n} partners")
    return shares


def read_stack(catalog, run_id: str) -> Stack | None:
    """The blend a run saved (its partners refitted), or None."""
    from jobs.training.run_weights import read_predictor
    from zoocore.errors import JobError

    raw = catalog.read_artifact(run_id, "stack.json")
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        if doc.get("format") != STACK_FORMAT:
            raise ValueError(f"not a {STACK_FORMAT} file")
        stack = Stack(str(doc["metanetwork"]), [str(p) for p in doc["partners"]], float(doc["weight"]),
                      candidates=[str(p) for p in doc.get("candidates", doc["partners"])],
                      residual=bool(doc.get("residual", False)), line=Line.from_dict(doc.get("line")),
                      shares=_shares(doc.get("shares"), len(doc["partners"])))
        if doc.get("fallback") is not None:       # runs saved before plain statistics where trusted: none
            fb = doc["fallback"]
            stack.fallback = Stack(stack.metanetwork, [str(p) for p in fb["partners"]], float(fb["weight"]),
                                   candidates=[str(p) for p in fb["candidates"]], residual=stack.residual,
                                   line=Line.from_dict(fb.get("line")),
                                   shares=_shares(fb.get("shares"), len(fb["partners"])))
            stack.gate = TrustProfile.from_dict(doc["gate"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise JobError(f"cannot read the blend of run {run_id}: {exc}") from None
    for part, prefix in ((stack, "stack"), (stack.fallback, "stack-fallback")):
        for partner in part.partners if part is not None else ():
            predictor = read_predictor(catalog, run_id, f"{prefix}-{partner}")
            if predictor is None:
                raise JobError(f"run {run_id}: the blend's {partner} is missing")
            part.predictors.append(predictor)
    return stack

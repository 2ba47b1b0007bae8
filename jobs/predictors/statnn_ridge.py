"""StatNN's features into ridge regression: the simplest learner on the statistics, a floor that
any other predictor should clear. Missing slots are imputed with indicator columns and the
features standardised; the penalty is chosen on the validation split."""
from __future__ import annotations

from jobs.predictors.tabular import StatNN


class StatNNRidge(StatNN):
    name = "statnn_ridge"
    grid = [{"alpha": a} for a in (0.1, 1.0, 10.0, 100.0, 1000.0)]

    @staticmethod
    def learner(task: str, params: dict, n_train: int, seed: int):
        from sklearn.impute import SimpleImputer
        from sklearn.linear_model import Ridge, RidgeClassifier
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        from jobs.training.tasks import task_named

        model = Ridge if task_named(task).numeric else RidgeClassifier
        return make_pipeline(SimpleImputer(strategy="constant", fill_value=0.0, add_indicator=True), StandardScaler(),
                             model(**params))

"""Export classical-ML models with skl2onnx and onnxmltools, each beside the data it was fit on.

    <venv with scikit-learn, skl2onnx, onnxmltools, lightgbm, xgboost>/bin/python bench/export_sklearn.py OUT_DIR

Fits estimators on the datasets scikit-learn ships (digits, breast cancer, diabetes, iris,
wine; no download), fixed seeds, and writes OUT_DIR/sklearn_<name>.onnx with the exporters'
defaults (classifiers' probabilities as ZipMap's sequence of per-class maps unless noted) and
OUT_DIR/sklearn_<name>.npy, the inputs to compare on. Run by bench/bench_exporters.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightgbm
import numpy as np
import onnxmltools
import xgboost
from onnxmltools.convert.common.data_types import FloatTensorType
from skl2onnx import to_onnx
from sklearn import datasets
from sklearn.cluster import KMeans
from sklearn.decomposition import PCA
from sklearn.ensemble import GradientBoostingRegressor, RandomForestClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.neighbors import KNeighborsClassifier
from sklearn.neural_network import MLPClassifier, MLPRegressor
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import SVC


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)

    def save(name: str, model: object, x: np.ndarray) -> None:
        (out / f"sklearn_{name}.onnx").write_bytes(model.SerializeToString())  # type: ignore[attr-defined]
        np.save(out / f"sklearn_{name}.npy", x)

    def load(loader) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN001
        data = loader()
        return data.data.astype(np.float32), data.target

    digits, cancer, diabetes = load(datasets.load_digits), load(datasets.load_breast_cancer), load(datasets.load_diabetes)
    iris, wine = load(datasets.load_iris), load(datasets.load_wine)

    mlp = make_pipeline(StandardScaler(), MLPClassifier(hidden_layer_sizes=(64, 32), max_iter=300, random_state=0))
    save("mlp_digits", to_onnx(mlp.fit(*digits), digits[0][:1], target_opset=17), digits[0])
    logistic = make_pipeline(StandardScaler(), LogisticRegression(max_iter=500))
    save("logreg_cancer", to_onnx(logistic.fit(*cancer), cancer[0][:1], target_opset=15, options={"zipmap": False}), cancer[0])
    regressor = make_pipeline(StandardScaler(), MLPRegressor(hidden_layer_sizes=(32,), max_iter=500, random_state=0))
    save("mlp_diabetes", to_onnx(regressor.fit(*diabetes), diabetes[0][:1], target_opset=17), diabetes[0])
    save("svc_iris", to_onnx(SVC(probability=True, random_state=0).fit(*iris), iris[0][:1], target_opset=15), iris[0])
    forest = RandomForestClassifier(20, random_state=0).fit(*wine)
    save("forest_wine", to_onnx(forest, wine[0][:1], target_opset={"": 17, "ai.onnx.ml": 3}), wine[0])
    boosted = GradientBoostingRegressor(n_estimators=30, random_state=0).fit(*diabetes)
    save("boosting_diabetes", to_onnx(boosted, diabetes[0][:1], target_opset=17), diabetes[0])
    clusters = make_pipeline(PCA(16), KMeans(8, random_state=0, n_init=3)).fit(digits[0])
    save("pca_kmeans_digits", to_onnx(clusters, digits[0][:1], target_opset=17), digits[0])
    neighbours = KNeighborsClassifier(5).fit(*digits)
    save("knn_digits", to_onnx(neighbours, digits[0][:1], target_opset=17, options={"zipmap": False}), digits[0])
    features = [("X", FloatTensorType([None, cancer[0].shape[1]]))]
    gbm = lightgbm.LGBMClassifier(n_estimators=20, verbose=-1).fit(*cancer)
    save("lightgbm_cancer", onnxmltools.convert_lightgbm(gbm, initial_types=features, target_opset=15), cancer[0])
    features = [("X", FloatTensorType([None, diabetes[0].shape[1]]))]
    xgb = xgboost.XGBRegressor(n_estimators=20, random_state=0).fit(*diabetes)
    save("xgboost_diabetes", onnxmltools.convert_xgboost(xgb, initial_types=features, target_opset=15), diabetes[0])


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""What MovieLens's behaviour history holds beyond its mean: logistic regressions on a few
hand-made features of each row's past ratings, on the towers' own split (the study's protocol:
`data.split = "time"`, `split_at = 0.8`, `valid_fraction = 0.1`, cut by trainer/data/time_split.py;
the regressions train on its training rows and are scored on its test rows by
trainer/metrics/ranking.py's AUC). docs/results.md, "The time bias: recency in the weights".

    .venv/bin/python bench/ml_ceiling.py [--config configs/movielens.toml] [--set data.KEY=VALUE ...]

Every model has the base features: the user's mean past stars, log(1 + how many) and the
candidate item's click rate in the training rows (smoothed towards the mean by 10 rows; a
training row's own label left out). Each further row adds one feature: the newest k ratings'
mean stars less the user's mean, or the mean stars of the behaviours of the candidate's genre
less the user's mean. L-BFGS in torch.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from trainer.config_loader import load_config
from trainer.data.datasets import build_dataset
from trainer.metrics.ranking import auc

PROTOCOL = ["--data.split=time", "--data.split_at=0.8", "--data.valid_fraction=0.1"]  # rankmix study's
BASE = ["mean stars", "log1p(count)", "item click rate"]
RECENT = (1, 3, 5, 10)
NO_HISTORY = 3.5  # a row with no past rating: the middle of the stars


def load(path: str) -> dict:
    """The columns this needs, as numpy arrays and lists of lists."""
    table = pq.read_table(path, columns=["item_id", "item_genre", "hist_ratings", "hist_genres", "label"])
    return {"item_id": table["item_id"].to_numpy(), "item_genre": table["item_genre"].to_numpy(),
            "label": pc.cast(table["label"], "int64").to_numpy(),
            "hist_ratings": table["hist_ratings"].to_pylist(), "hist_genres": table["hist_genres"].to_pylist()}


def features(rows: dict, click_rate: np.ndarray) -> np.ndarray:
    """[N, 3 + len(RECENT) + 1]: BASE, then each RECENT window's mean less the user's, then the
    candidate's genre's mean less the user's (0 where the history has none of it). `click_rate`:
    one per row (see `click_rates`)."""
    out = []
    for rate, genre, stars, genres in zip(click_rate, rows["item_genre"], rows["hist_ratings"],
                                          rows["hist_genres"]):
        stars, genres = np.asarray(stars, dtype=np.float64), np.asarray(genres)
        mean = stars.mean() if len(stars) else NO_HISTORY
        recent = [stars[-k:].mean() - mean if len(stars) else 0.0 for k in RECENT]
        same = genres == genre
        out.append([mean, np.log1p(len(stars)), rate, *recent,
                    stars[same].mean() - mean if same.any() else 0.0])
    return np.asarray(out)


def click_rates(train: dict, rows: dict, own: bool) -> np.ndarray:
    """Each row's item's click rate in `train`, smoothed towards the mean by 10 rows; `own`: the
    rows are train's, and each leaves its own label out (else the feature holds the answer)."""
    items = int(max(train["item_id"].max(), rows["item_id"].max())) + 1
    prior = train["label"].mean()
    seen = np.bincount(train["item_id"], minlength=items).astype(np.float64)
    clicked = np.bincount(train["item_id"], weights=train["label"], minlength=items)
    seen, clicked = seen[rows["item_id"]], clicked[rows["item_id"]]
    if own:
        seen, clicked = seen - 1, clicked - rows["label"]
    return (clicked + 10 * prior) / (seen + 10)


def fit_auc(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray) -> float:
    """A logistic regression fitted by L-BFGS on standardised features; its test AUC."""
    mu, sd = x_train.mean(0), x_train.std(0) + 1e-9
    x = torch.tensor((x_train - mu) / sd)
    y = torch.tensor(y_train, dtype=torch.float64)
    linear = torch.nn.Linear(x.shape[1], 1).double()
    opt = torch.optim.LBFGS(linear.parameters(), max_iter=200)

    def loss():
        opt.zero_grad()
        value = torch.nn.functional.binary_cross_entropy_with_logits(linear(x).squeeze(1), y)
        value.backward()
        return value
    opt.step(loss)
    with torch.no_grad():
        scores = linear(torch.tensor((x_test - mu) / sd)).squeeze(1).numpy()
    return auc(torch.from_numpy(scores), torch.from_numpy(y_test))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/movielens.toml", help="the towers' config: its data and split")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override, as `rankmix "
                   "study --set`, after the protocol's")
    args = p.parse_args(argv)
    files = build_dataset(load_config(args.config, [*PROTOCOL, *(f"--{kv}" for kv in args.set)]))
    train, test = load(files.train_path), load(files.eval_path)
    x_train = features(train, click_rates(train, train, own=True))
    x_test = features(test, click_rates(train, test, own=False))
    names = [*(f"newest {k}'s mean stars - the user's" for k in RECENT),
             "the candidate genre's mean stars - the user's"]
    base = list(range(len(BASE)))
    print(f"{len(train['label'])} training rows, {len(test['label'])} test rows")
    print("| features | test AUC |\n|---|---|")
    print(f"| {', '.join(BASE)} | {fit_auc(x_train[:, base], train['label'], x_test[:, base], test['label']):.4f} |")
    for i, name in enumerate(names):
        cols = [*base, len(BASE) + i]
        print(f"| + {name} | {fit_auc(x_train[:, cols], train['label'], x_test[:, cols], test['label']):.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

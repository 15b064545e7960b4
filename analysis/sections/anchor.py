"""'Where the anchor acted, by token entropy': the tables of the training log's
``anchor_buckets/<bucket>/<stat>`` (``load.BUCKET_TABLES``) and one step x bucket figure per statistic."""

from __future__ import annotations

from analysis import figures, load, tables
from analysis.inputs import Inputs
from analysis.load import BUCKET_TABLES
from analysis.page import Page
from sage.train.figures import BUCKETS

# below the tables of the training log's anchor_buckets/<bucket>/<stat> (load.BUCKET_TABLES)
BUCKET_TEXT = (
    "Buckets: each step's token-entropy quintiles (q1 lowest) and the tokens above 1.2 nats (the Branch "
    "guide's default threshold). The anchor's share is the sum of |anchor signal| over the bucket's tokens "
    "over that of |anchor signal| + |policy-gradient signal| (sage.objective.buckets); 0 without an anchor."
)


def add(page: Page, inputs: Inputs) -> None:
    trained = inputs.trained
    buckets = trained[["run_id", "row", "seed"]].merge(
        load.bucket_frame(inputs.client, trained, [stat for stat, _ in BUCKET_TABLES]), on="run_id"
    )
    if buckets.empty:
        page.notes.append(
            "no 'Where the anchor acted' section: no run logged train/anchor_buckets/<bucket>/<stat> "
            "(sage.objective.buckets)"
        )
        return
    heading = "Where the anchor acted, by token entropy"
    trained_rows = sorted(trained["row"].unique(), key=tables.row_key)
    for stat, title in BUCKET_TABLES:
        per_run = buckets[buckets["stat"] == stat].groupby(["row", "seed", "bucket"], as_index=False)
        frame = per_run["value"].mean().rename(columns={"bucket": "column"})
        columns = [b for b in BUCKETS if b in set(frame["column"])]
        t = tables.seed_table(
            frame, inputs.asked, columns, name=f"anchor_buckets_{stat}", title=title, rows=trained_rows
        )
        page.table(t, heading, BUCKET_TEXT if stat == BUCKET_TABLES[0][0] else "")
        heading = None
    for p in figures.anchor_buckets(buckets, page.figures_dir):
        caption = f"where the anchor acted, {p.stem.removeprefix('anchor_buckets_')}: step x bucket"
        page.figure(p.stem, p, caption + ", each cell the mean over the row's seeds")

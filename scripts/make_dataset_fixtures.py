"""Writes tests/fixtures/datasets/hub: a tiny Hugging Face cache with three datasets in the hub's
own Parquet layout, made from the hand-written samples in tasks/samples (for the tests of
`occult eval` reading cached datasets; the tests do not need Python).

    /tmp/pyenv/bin/python scripts/make_dataset_fixtures.py    # needs pyarrow
"""
import json
import pathlib
import shutil

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests/fixtures/datasets/hub"
COMMIT = "1111111111111111111111111111111111111111"

# (repo, sample task, folder inside the snapshot, {split: sample split})
LAYOUTS = [
    ("allenai/ai2_arc", "arc_easy", "ARC-Easy", {"test": "test", "train": "train"}),
    ("Rowan/hellaswag", "hellaswag", "data", {"validation": "validation", "train": "train"}),
    ("openai/gsm8k", "gsm8k", "main", {"test": "test", "train": "train"}),
]


def rows(task, split):
    path = ROOT / "tasks/samples" / task / f"{split}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main():
    shutil.rmtree(OUT, ignore_errors=True)
    for repo, task, folder, splits in LAYOUTS:
        base = OUT / ("datasets--" + repo.replace("/", "--"))
        (base / "refs").mkdir(parents=True)
        (base / "refs/main").write_text(COMMIT)
        snap = base / "snapshots" / COMMIT / folder
        snap.mkdir(parents=True)
        for split, sample in splits.items():
            table = pa.Table.from_pylist(rows(task, sample))
            pq.write_table(table, snap / f"{split}-00000-of-00001.parquet", compression="snappy")
    print("wrote", OUT)


if __name__ == "__main__":
    main()

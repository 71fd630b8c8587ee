#!/usr/bin/env python3
"""Writes tests/fixtures/lmeval_prompts.json: the (context, continuation) requests that
lm-evaluation-harness 0.4.13 builds for the built-in task samples (tasks/samples), with few-shot
examples (seed 1234). occult-eval's prompts are held to them, whole.

Needs lm_eval 0.4.13 installed (`pip install lm_eval==0.4.13`; it loads the samples with
`datasets` through dataset_path: json). Run: python3 scripts/make_prompt_fixtures.py
"""
import json
import tempfile
from pathlib import Path

from lm_eval.api.task import ConfigurableTask
from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "tasks" / "samples"
SEED = 1234
# task: (its splits in the samples, shots); shots stay within the small few-shot pools.
TASKS = {
    "arc_easy": ({"train": "train", "test": "test"}, 2),
    "arc_challenge": ({"train": "train", "test": "test"}, 2),
    # Scored on validation: the harness draws n + 1 from train, so the pool needs n + 1.
    "piqa": ({"train": "train", "validation": "validation"}, 1),
    "boolq": ({"train": "train", "validation": "validation"}, 1),
    "hellaswag": ({"train": "train", "validation": "validation"}, 1),
    "copa": ({"train": "train", "validation": "validation"}, 1),
    "rte": ({"train": "train", "validation": "validation"}, 1),
    "winogrande": ({"train": "train", "validation": "validation"}, 1),
    "wsc": ({"train": "train", "validation": "validation"}, 1),
    "openbookqa": ({"train": "train", "test": "test"}, 1),
    "sciq": ({"train": "train", "test": "test"}, 1),
    "mathqa": ({"train": "train", "test": "test"}, 1),
    # Examples from the test split itself, the document not excluded.
    "race": ({"test": "test"}, 2),
    # One harness task per subject (mmlu_SUBJECT), first_n from its dev split.
    "mmlu": ({"dev": "dev", "test": "test"}, 5),
}


def configure(tm, name, data_files, shots):
    """The harness's task `name`, its YAML with `!function` entries and includes resolved,
    reading `data_files` (split -> path) through dataset_path: json."""
    c = dict(load_yaml(tm.task_index[name].yaml_path))
    c.pop("tag", None)
    c["dataset_path"] = "json"
    c["dataset_name"] = None
    c["dataset_kwargs"] = {"data_files": {k: str(v) for k, v in data_files.items()}}
    for k in ["training_split", "validation_split", "test_split", "fewshot_split"]:
        if c.get(k) and c[k] not in data_files:
            c[k] = None
    c["num_fewshot"] = shots
    t = ConfigurableTask(config=c)
    t.set_fewshot_seed(SEED)
    return t


def harness_tasks(tm, name, splits, shots, tmp):
    """The harness tasks that score the samples of our task `name`, in our document order:
    one, or for MMLU one per subject (the samples' split files cut by subject into `tmp`).
    Returns (harness name, task, our document index of each of its documents)."""
    files = {k: SAMPLES / name / f"{v}.jsonl" for k, v in splits.items()}
    if name != "mmlu":
        t = configure(tm, name, files, shots)
        n = len(files["test" if "test" in files else "validation"].read_text().splitlines())
        return [(name, t, list(range(n)))]
    rows = {k: [json.loads(l) for l in f.read_text().splitlines() if l] for k, f in files.items()}
    out = []
    for subject in dict.fromkeys(r["subject"] for r in rows["test"]):
        cut = {}
        for k, rs in rows.items():
            cut[k] = Path(tmp) / f"{subject}_{k}.jsonl"
            cut[k].write_text("".join(json.dumps(r) + "\n" for r in rs if r["subject"] == subject))
        ours = [i for i, r in enumerate(rows["test"]) if r["subject"] == subject]
        out.append((f"mmlu_{subject}", configure(tm, f"mmlu_{subject}", cut, shots), ours))
    return out


def requests(task):
    """Each document's (context, continuation) requests, in document order."""
    task.build_all_requests(rank=0, world_size=1)
    docs = {}
    for inst in task.instances:
        docs.setdefault(inst.doc_id, []).append(list(inst.args))
    return [docs[i] for i in sorted(docs)]


def main():
    tm = TaskManager()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (splits, shots) in TASKS.items():
            docs = {}
            for _, task, ours in harness_tasks(tm, name, splits, shots, tmp):
                docs.update(zip(ours, requests(task)))
            out[name] = {"shots": shots, "docs": [docs[i] for i in sorted(docs)]}
            print(f"{name}: {len(docs)} documents, {shots}-shot")
    path = ROOT / "tests" / "fixtures" / "lmeval_prompts.json"
    path.write_text(json.dumps({"lm_eval": "0.4.13", "seed": SEED, "tasks": out}) + "\n")
    print(f"wrote {path} ({len(out)} tasks)")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Writes tests/fixtures/lmeval_prompts.json: the (context, continuation) requests that
lm-evaluation-harness 0.4.13 builds for the built-in task samples (tasks/samples), with few-shot
examples (seed 1234). occult-eval's prompts are held to them, whole.

Needs lm_eval 0.4.13 installed (`pip install lm_eval==0.4.13`; it loads the samples with
`datasets` through dataset_path: json). Run: python3 scripts/make_prompt_fixtures.py
"""
import json
from pathlib import Path

from lm_eval.api.task import ConfigurableTask
from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "tasks" / "samples"
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
    "openbookqa": ({"train": "train", "test": "test"}, 1),
    "sciq": ({"train": "train", "test": "test"}, 1),
    "mathqa": ({"train": "train", "test": "test"}, 1),
    # Examples from the test split itself, the document not excluded.
    "race": ({"test": "test"}, 2),
}


def build(tm, name, splits, shots):
    # The task's YAML with its `!function` entries resolved (process_docs and the like).
    c = dict(load_yaml(tm.task_index[name].yaml_path))
    c.pop("tag", None)
    c["dataset_path"] = "json"
    c["dataset_name"] = None
    c["dataset_kwargs"] = {
        "data_files": {k: str(SAMPLES / name / f"{v}.jsonl") for k, v in splits.items()}
    }
    for k in ["training_split", "validation_split", "test_split"]:
        if c.get(k) and c[k] not in splits:
            c[k] = None
    c["num_fewshot"] = shots
    t = ConfigurableTask(config=c)
    t.set_fewshot_seed(1234)
    t.build_all_requests(rank=0, world_size=1)
    docs = {}
    for inst in t.instances:
        docs.setdefault(inst.doc_id, []).append(list(inst.args))
    return [docs[i] for i in sorted(docs)]


def main():
    tm = TaskManager()
    out = {}
    for name, (splits, shots) in TASKS.items():
        out[name] = {"shots": shots, "docs": build(tm, name, splits, shots)}
        print(f"{name}: {len(out[name]['docs'])} documents, {shots}-shot")
    path = ROOT / "tests" / "fixtures" / "lmeval_prompts.json"
    path.write_text(json.dumps({"lm_eval": "0.4.13", "seed": 1234, "tasks": out}) + "\n")
    print(f"wrote {path} ({len(out)} tasks)")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Writes tests/fixtures/lmeval_scores.json: per-item log-likelihoods and metrics that
lm-evaluation-harness 0.4.13 (its HF causal-LM backend, float32 on CPU) gives the tiny fixture
model tests/fixtures/models/qwen2_moe on the built-in samples of all 14 tasks, zero-shot and
with the few-shot counts of make_prompt_fixtures.py (seed 1234). occult eval is held to them,
item by item.

Needs lm_eval 0.4.13 with torch and transformers (`pip install lm_eval==0.4.13 torch
transformers accelerate`). Run: python3 scripts/make_score_fixtures.py
"""
import json
import sys
import tempfile
from pathlib import Path

from lm_eval.evaluator import evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_prompt_fixtures import ROOT, SEED, TASKS, harness_tasks  # noqa: E402

MODEL = "qwen2_moe"


def gold(task, doc):
    """The gold choice's index, as the harness's multiple-choice scoring finds it (its logged
    `target` is the answer text for COPA and the shared continuation for WinoGrande)."""
    if task.multiple_input:
        return task.doc_to_text(doc)
    g = task.doc_to_target(doc)
    return task.doc_to_choice(doc).index(g) if isinstance(g, str) else g


def score(lm, tm, shots_of, tmp):
    """Per task, its items in our document order: log-likelihood per choice, acc, acc_norm."""
    out = {}
    for name, (splits, shots) in TASKS.items():
        n = shots_of(shots)
        parts = harness_tasks(tm, name, splits, n, tmp)
        res = evaluate(lm=lm, task_dict={h: t for h, t, _ in parts}, log_samples=True)
        items = {}
        for h, task, ours in parts:
            for s in res["samples"][h]:
                items[ours[s["doc_id"]]] = {
                    "loglikelihoods": [r[0] for r in s["filtered_resps"]],
                    "acc": s["acc"],
                    "acc_norm": s.get("acc_norm"),
                    "target": gold(task, s["doc"]),
                }
        out[name] = {"shots": n, "docs": [items[i] for i in sorted(items)]}
        print(f"{name}: {len(items)} documents, {n}-shot")
    return out


def main():
    path = ROOT / "tests" / "fixtures" / "models" / MODEL
    lm = HFLM(pretrained=str(path), device="cpu", dtype="float32", batch_size=1)
    tm = TaskManager()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [score(lm, tm, lambda _: 0, tmp), score(lm, tm, lambda s: s, tmp)]
    out = ROOT / "tests" / "fixtures" / "lmeval_scores.json"
    doc = {"lm_eval": "0.4.13", "model": MODEL, "seed": SEED, "runs": runs}
    out.write_text(json.dumps(doc) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

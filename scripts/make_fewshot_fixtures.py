#!/usr/bin/env python3
"""Writes tests/fixtures/lmeval_fewshot.json: the few-shot examples lm-evaluation-harness 0.4.13's
own samplers pick, document after document, for small pools (with duplicates of eval documents,
which exercise the resampling path). occult-eval's `draw_fewshot` is held to it.

Needs lm_eval 0.4.13 importable (`pip install lm_eval==0.4.13`), or LM_EVAL_SRC naming a folder
that holds the unpacked wheel (`pip download lm_eval==0.4.13 --no-deps` and unzip): only
`lm_eval/api/samplers.py` is loaded, which needs the standard library alone.
"""
import importlib.util
import json
import os
from pathlib import Path


def load_samplers():
    src = os.environ.get("LM_EVAL_SRC")
    if src:
        path = Path(src) / "lm_eval" / "api" / "samplers.py"
        spec = importlib.util.spec_from_file_location("samplers", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    from lm_eval.api import samplers

    return samplers


def main():
    samplers = load_samplers()
    cases = []
    # Pools of documents {"id": i}; "dup" documents repeat an eval document's value.
    for seed in [1234, 0, 42]:
        for shots in [1, 3, 5]:
            for sampler in ["default", "first_n"]:
                for same_split in [True, False]:
                    eval_docs = [{"id": i} for i in range(12)]
                    if same_split:
                        # Copies of eval documents 2 and 5 in the pool make the harness drop
                        # more than one drawn document now and then.
                        pool = eval_docs + [{"id": 2}, {"id": 5}, {"id": 5}]
                    else:
                        pool = [{"id": 100 + i} for i in range(9)]
                    s = samplers.get_sampler(sampler)(list(pool), rnd=seed)
                    picks = []
                    for doc in eval_docs:
                        got = s.sample(n=shots, eval_doc=doc if same_split else None)
                        # Indices into the pool; equal documents are told apart by position:
                        # the harness returns the pool's own objects.
                        picks.append([next(j for j, p in enumerate(pool) if p is g) for g in got])
                    cases.append(
                        {
                            "seed": seed,
                            "shots": shots,
                            "sampler": sampler,
                            "same_split": same_split,
                            "pool": [p["id"] for p in pool],
                            "eval": [d["id"] for d in eval_docs],
                            "picks": picks,
                        }
                    )
    # Many copies of two eval documents: drawing n + 1 often removes two or more, and the
    # harness draws again from the pool without them.
    for seed in [1234, 7]:
        for shots in [3, 5]:
            eval_docs = [{"id": i} for i in range(6)]
            pool = eval_docs + [{"id": 5} for _ in range(4)] + [{"id": 2} for _ in range(2)]
            s = samplers.get_sampler("default")(list(pool), rnd=seed)
            picks = []
            for doc in eval_docs:
                got = s.sample(n=shots, eval_doc=doc)
                picks.append([next(j for j, p in enumerate(pool) if p is g) for g in got])
            cases.append(
                {
                    "seed": seed,
                    "shots": shots,
                    "sampler": "default",
                    "same_split": True,
                    "pool": [p["id"] for p in pool],
                    "eval": [d["id"] for d in eval_docs],
                    "picks": picks,
                }
            )
    out = {"lm_eval": "0.4.13", "cases": cases}
    path = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "lmeval_fewshot.json"
    path.write_text(json.dumps(out) + "\n")
    print(f"wrote {path} ({len(cases)} cases)")


if __name__ == "__main__":
    main()

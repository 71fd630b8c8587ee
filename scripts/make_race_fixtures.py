#!/usr/bin/env python3
"""Writes tests/fixtures/lmeval_race.json: what lm-evaluation-harness 0.4.13's own
`tasks/race/preprocess_race.py` makes of the built-in RACE samples (tasks/samples/race): the
prompt text, the choices and the gold index. occult-eval's RACE preprocessing is held to it.

Needs lm_eval 0.4.13 importable, or LM_EVAL_SRC naming the unpacked wheel (see
make_fewshot_fixtures.py); preprocess_race.py needs the standard library alone.
"""
import importlib.util
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load():
    src = os.environ.get("LM_EVAL_SRC")
    if src:
        path = Path(src) / "lm_eval" / "tasks" / "race" / "preprocess_race.py"
    else:
        import lm_eval

        path = Path(lm_eval.__file__).parent / "tasks" / "race" / "preprocess_race.py"
    spec = importlib.util.spec_from_file_location("preprocess_race", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    race = load()
    docs = [json.loads(l) for l in (ROOT / "tasks/samples/race/test.jsonl").read_text().splitlines() if l]
    out = [
        {"text": race.doc_to_text(d), "choices": race.doc_to_choice(d), "gold": race.doc_to_target(d)}
        for d in docs
    ]
    path = ROOT / "tests" / "fixtures" / "lmeval_race.json"
    path.write_text(json.dumps({"lm_eval": "0.4.13", "docs": out}, indent=1) + "\n")
    print(f"wrote {path} ({len(out)} documents)")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Writes tests/fixtures/generative/: a tiny GSM8K-shaped data set, lm-evaluation-harness 0.4.13's
own `gsm8k`, `gsm8k_cot` and `gsm8k_cot_zeroshot` task YAMLs pointed at it, and what lm-eval's
HF causal-LM backend (float32 on CPU, greedy) does with them on the tiny fixture models
tests/fixtures/models/olmoe and qwen3_moe: each request's context and gen_kwargs, the tokens fed,
the tokens generated, `resps`, `filtered_resps` and `exact_match` per filter, and the aggregated
results with their stderr. occult eval's `generate_until` path is held to them, token for token.

Files written (JSON is compact, UTF-8):
- `train.jsonl` (few-shot pool of gsm8k and gsm8k_cot_zeroshot) and `test.jsonl` (9 items; the last
  three were picked because qwen3_moe's garbage output happens to contain their answer in one
  0-shot prompt, so `exact_match` 1 occurs in a real run), fields `question` and `answer`
  (GSM8K's format: reasoning with `<<a*b=c>>` annotations, then `#### N`);
- `gsm8k.yaml`, `gsm8k_cot.yaml`, `gsm8k_cot_zeroshot.yaml`: the harness's files, text unchanged
  but for `dataset_path: json`, `dataset_kwargs.data_files` (paths from the repository root),
  `dataset_name` removed, and `max_gen_toks: 32` added to `generation_kwargs`. The last one is
  needed, not a speed-up: the fixture models have max_position_embeddings 128, which is lm-eval's
  max_length, and lm-eval asserts max_length - max_gen_toks > 0 (the default 256 fails). It is
  what `--gen_kwargs max_gen_toks=32` does on the command line. Contexts are left-truncated to
  the last 128 - 32 = 96 tokens: every few-shot context here is, the 0-shot ones are not;
- `gsm8k_cot_stops.yaml`: NOT a harness task. gsm8k_cot, 0-shot, with `until` extended by strings
  these models do emit ("hh", ",,", "is"), so that lm-eval's stop handling (the stopping criterion
  on decoded text, the cut at the first stop string) is exercised by a real generation;
- `prompts.json`: per run (task, num_fewshot): per document its context string, gen_kwargs, the
  number of tokens of the context (`HFLM.tok_encode`, no special tokens here) and `input_ids`, the
  left-truncated window fed to `generate` (the same for both models: one tokenizer);
- `olmoe.json`, `qwen3_moe.json`: per run, per document: `gen_ids` (the tokens `generate`
  returned after the context, batch size 1: it stops early when a stop string shows up in the
  decoded last len(encode(stop)) + 2 tokens, or at <|endoftext|>), `resps` (decoded with
  skip_special_tokens, cut at the stop strings), `filtered` and `exact_match` per filter; the
  run's `results` (lm-eval's own dict: `exact_match,<filter>` and `exact_match_stderr,<filter>`);
  and `batch4_same`: whether a second run at batch size 4 gave the same resps, filtered resps and
  results (it must);
- `scripted.json`: lm-eval's own `evaluate` with a scripted LM (no model) that answers each
  document with a crafted text (rounds of templates built from the document's answer): the
  regex filters, `take_first`, `exact_match` (with its regexes_to_ignore) and the stderr on
  responses that hit every branch ("[invalid]", first vs last match, `$`, `,`, trailing `.`);
- `postprocess.json`: lm-eval's `handle_stop_sequences` + `postprocess_generated_text` (how a
  decoded generation is cut at the stop strings) on crafted texts.

Each run is one `evaluate` call per (task, num_fewshot), the few-shot seed 1234 as
`simple_evaluate` sets it. Every task is built by `ConfigurableTask` from the fixture YAML.

Needs lm_eval 0.4.13 with torch and transformers (`pip install lm_eval==0.4.13 torch
transformers accelerate`; generated with torch 2.15.0, transformers 5.25.0, datasets 5.2.0, all
CPU, no network: the data are read through datasets' `json` builder). About 40 s on 2 cores.
Deterministic (two runs give the same sha256 for every file). Run from anywhere:
python3 scripts/make_generative_fixtures.py
"""
import hashlib
import json
import os
from pathlib import Path

import lm_eval
from lm_eval.api.model import LM
from lm_eval.api.task import ConfigurableTask
from lm_eval.evaluator import evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, postprocess_generated_text
from lm_eval.tasks._yaml_loader import load_yaml

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "generative"
REL = "tests/fixtures/generative"
HARNESS_TASKS = Path(lm_eval.__file__).parent / "tasks" / "gsm8k"
SEED = 1234
MAX_GEN_TOKS = 32
MODELS = ["olmoe", "qwen3_moe"]
BATCH = 4

TRAIN = [
    ("Tom has 3 apples. He buys 4 more. How many apples does he have?",
     "Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"),
    ("A box holds 6 eggs. How many eggs are in 5 boxes?",
     "5 boxes hold 5 * 6 = <<5*6=30>>30 eggs.\n#### 30"),
    ("Sara had $20 and spent $8. How much does she have left?",
     "She has $20 - $8 = $<<20-8=12>>12 left.\n#### 12"),
    ("Ben reads 10 pages a day. How many pages does he read in a week?",
     "A week has 7 days.\nHe reads 10 * 7 = <<10*7=70>>70 pages.\n#### 70"),
    ("Mia is 9. Her brother is twice her age. How old is he?",
     "He is 9 * 2 = <<9*2=18>>18 years old.\n#### 18"),
    ("Four friends share 2 pizzas of 8 slices equally. How many slices does each get?",
     "There are 2 * 8 = <<2*8=16>>16 slices.\nEach gets 16 / 4 = <<16/4=4>>4 slices.\n#### 4"),
    ("A shop sells 1,200 pens a month. How many does it sell in a year?",
     "It sells 1,200 * 12 = <<1200*12=14400>>14,400 pens.\n#### 14400"),
    ("It is 5 degrees and gets 7 degrees colder. What is the temperature?",
     "It is 5 - 7 = <<5-7=-2>>-2 degrees.\n#### -2"),
]
TEST = [
    ("Lily has 5 pens and finds 2 more. How many pens does she have?",
     "Lily has 5 + 2 = <<5+2=7>>7 pens.\n#### 7"),
    ("A cat sleeps 16 hours a day. How many hours is it awake?",
     "A day has 24 hours.\nIt is awake 24 - 16 = <<24-16=8>>8 hours.\n#### 8"),
    ("Max buys 3 books at $4 each. How much does he pay?",
     "He pays 3 * $4 = $<<3*4=12>>12.\n#### 12"),
    ("A farm has 1,000 hens and sells 200. How many are left?",
     "1,000 - 200 = <<1000-200=800>>800 hens are left.\n#### 800"),
    ("A tank holds 50 liters. Half of it leaks out. How much is left?",
     "50 / 2 = <<50/2=25>>25 liters are left.\n#### 25"),
    ("A shop sells 100 pens a day. How many does it sell in 12 days?",
     "100 * 12 = <<100*12=1200>>1200 pens.\n#### 1200"),
    # Crafted: qwen3_moe's greedy output holds the answer in the 0-shot gsm8k_cot (first two)
    # and gsm8k_cot_zeroshot (third) prompts, so flexible-extract scores 1 there.
    ("Ann had 8 books and gave away 3. How many are left?",
     "Ann has 8 - 3 = <<8-3=5>>5 books left.\n#### 5"),
    ("Bob has 6 hats. How many hats does Bob have?",
     "Bob has 6 hats.\n#### 6"),
    ("Bob has 4 shells. How many shells does Bob have?",
     "Bob has 4 shells.\n#### 4"),
]

# (task, num_fewshot): each task's default count (5, 8, 0) and 0 and 1 shots.
RUNS = [
    ("gsm8k", 0), ("gsm8k", 1), ("gsm8k", 5),
    ("gsm8k_cot", 0), ("gsm8k_cot", 1), ("gsm8k_cot", 8),
    ("gsm8k_cot_zeroshot", 0),
    ("gsm8k_cot_stops", 0),
]
STOPS_EXTRA = ["hh", ",,", "is"]


def jsonl(rows):
    return "".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows)


def edit_yaml(text, data_files):
    """The harness's YAML text with the data read from local JSONL and max_gen_toks set."""
    lines = text.splitlines()
    out = []
    for line in lines:
        if line.startswith("dataset_path:"):
            out.append("dataset_path: json")
            out.append("dataset_kwargs:")
            out.append("  data_files:")
            for split, path in data_files.items():
                out.append(f"    {split}: {path}")
        elif line.startswith("dataset_name:"):
            continue
        elif line.startswith("generation_kwargs:"):
            out.append(line)
            out.append(f"  max_gen_toks: {MAX_GEN_TOKS}  # added: the fixture models have 128 positions")
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def write_yamls():
    files = {
        "gsm8k": ("gsm8k.yaml", ["train", "test"]),
        "gsm8k_cot": ("gsm8k-cot.yaml", ["test"]),
        "gsm8k_cot_zeroshot": ("gsm8k-cot-zeroshot.yaml", ["train", "test"]),
    }
    for task, (src, splits) in files.items():
        text = (HARNESS_TASKS / src).read_text()
        orig = load_yaml(HARNESS_TASKS / src)
        assert "include" not in text, f"{src} includes a base; inline it"
        data_files = {s: f"{REL}/{s}.jsonl" for s in splits}
        new = edit_yaml(text, data_files)
        (OUT / f"{task}.yaml").write_text(new)
        # Nothing else changed.
        mine = load_yaml(OUT / f"{task}.yaml")
        assert mine.pop("dataset_kwargs") == {"data_files": data_files}
        assert mine.pop("dataset_path") == "json" and orig.pop("dataset_path") == "openai/gsm8k"
        assert orig.pop("dataset_name") == "main"
        assert mine["generation_kwargs"].pop("max_gen_toks") == MAX_GEN_TOKS
        assert mine == orig, task
    # The variant with stop strings that these models emit.
    cot = (OUT / "gsm8k_cot.yaml").read_text()
    head = "# NOT a harness task: gsm8k_cot, 0-shot, `until` extended by strings the fixture\n" \
           "# models emit, to exercise lm-eval's stop handling on real generations.\n"
    cot = cot.replace("task: gsm8k_cot\n", "task: gsm8k_cot_stops\n")
    cot = cot.replace("num_fewshot: 8\n", "num_fewshot: 0\n")
    until = "  until:\n  - 'Q:'\n  - </s>\n  - <|im_end|>\n"
    assert until in cot
    cot = cot.replace(until, until + "".join(f"  - '{s}'\n" for s in STOPS_EXTRA))
    (OUT / "gsm8k_cot_stops.yaml").write_text(head + cot)


def make_task(name, shots):
    c = dict(load_yaml(OUT / f"{name}.yaml"))
    c.pop("tag", None)
    c["num_fewshot"] = shots
    t = ConfigurableTask(config=c)
    t.set_fewshot_seed(SEED)
    return t


class RecordingHFLM(HFLM):
    """lm-eval's HFLM, keeping the (unpadded) tokens fed to and returned by `generate`."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.generated = {}

    def _model_generate(self, context, max_length, stop, **kwargs):
        out = super()._model_generate(context, max_length, stop, **kwargs)
        mask = kwargs["attention_mask"]
        for row in range(context.shape[0]):
            fed = tuple(context[row][mask[row].bool()].tolist())
            self.generated[fed] = out[row, context.shape[1]:].tolist()
        return out


def results_of(res, name):
    r = res["results"][name]
    return {k: (v if isinstance(v, str) else float(v)) for k, v in r.items()
            if k.startswith("exact_match")}


def run_model(lm, prompts, record):
    """Every run on one model. `record` also keeps the tokens (batch size 1)."""
    out = {}
    for name, shots in RUNS:
        key = f"{name}/{shots}"
        task = make_task(name, shots)
        res = evaluate(lm=lm, task_dict={name: task}, log_samples=True)
        by_doc = {}
        for s in res["samples"][name]:
            d = by_doc.setdefault(s["doc_id"], {"filtered": {}, "exact_match": {}})
            (ctx, gen_kwargs), = s["arguments"]
            d["context"], d["gen_kwargs"] = ctx, gen_kwargs
            d["resps"] = s["resps"][0][0]
            d["filtered"][s["filter"]] = s["filtered_resps"][0]
            d["exact_match"][s["filter"]] = float(s["exact_match"])
        docs = []
        for i in sorted(by_doc):
            d = by_doc[i]
            item = {"resps": d["resps"], "filtered": d["filtered"], "exact_match": d["exact_match"]}
            if record:
                ids = lm.tok_encode(d["context"])
                max_ctx = lm.max_length - d["gen_kwargs"].get("max_gen_toks", lm.max_gen_toks)
                fed = ids[-max_ctx:]
                item = {"gen_ids": lm.generated[tuple(fed)], **item}
                p = prompts.setdefault(key, [None] * len(by_doc))
                entry = {"context": d["context"], "gen_kwargs": d["gen_kwargs"],
                         "context_len": len(ids), "input_ids": fed}
                assert p[i] is None or p[i] == entry
                p[i] = entry
            docs.append(item)
        out[key] = {"docs": docs, "results": results_of(res, name)}
        print(f"  {key}: {out[key]['results']}", flush=True)
    return out


# Crafted responses for the scripted runs, built from the document's final answer `a`.
TEMPLATES = [
    lambda a: f" She has 5 + 2 = <<5+2=7>>7.\n#### {a}",
    lambda a: f" The answer is {a}.",
    lambda a: f" The answer is {a}",
    lambda a: f" So the total is {int(a):,} in all.\n#### {int(a):,}",
    lambda a: f" It costs ${a}.00 in total.",
    lambda a: f" {a} or maybe {a}0.",
    lambda a: f"\n#### {a}\n#### 99",
    lambda a: " I don't know.",
    lambda a: f" The Answer Is {a}.",
    lambda a: f" -{a}",
    lambda a: f" 1,2,3 and then ${a}.",
    lambda a: f" The answer is {a}.\nThe answer is 13.",
    lambda a: "",
    lambda a: f" #### {a}.",
]


class ScriptedLM(LM):
    """Answers document i of round r with TEMPLATES[(i + r) % len(TEMPLATES)]."""

    def __init__(self, rnd):
        super().__init__()
        self.rnd = rnd

    def generate_until(self, requests, disable_tqdm=False):
        out = []
        for req in requests:
            a = req.doc["answer"].split("#### ")[-1]
            out.append(TEMPLATES[(req.doc_id + self.rnd) % len(TEMPLATES)](a))
        return out

    def loglikelihood(self, requests):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError


def scripted():
    out = {}
    for name in ["gsm8k", "gsm8k_cot", "gsm8k_cot_zeroshot"]:
        rounds, targets = [], {}
        for r in range(len(TEMPLATES)):
            res = evaluate(lm=ScriptedLM(r), task_dict={name: make_task(name, 0)}, log_samples=True)
            docs = {}
            for s in res["samples"][name]:
                targets[s["doc_id"]] = s["target"]
                d = docs.setdefault(s["doc_id"], {"resps": s["resps"][0][0],
                                                  "filtered": {}, "exact_match": {}})
                d["filtered"][s["filter"]] = s["filtered_resps"][0]
                d["exact_match"][s["filter"]] = float(s["exact_match"])
            rounds.append({"docs": [docs[i] for i in sorted(docs)],
                           "results": results_of(res, name)})
        out[name] = {"targets": [targets[i] for i in sorted(targets)], "rounds": rounds}
        hits = {f: sum(d["exact_match"][f] for r in rounds for d in r["docs"])
                for f in rounds[0]["docs"][0]["exact_match"]}
        print(f"  scripted {name}: exact_match hits {hits} of {len(rounds) * len(TEST)}")
    return out


def postprocess_cases():
    eos = "<|endoftext|>"
    cases = [
        ("12 apples.\n\nQuestion: next", ["Question:", "</s>", "<|im_end|>"]),
        ("A: 5\nQ: more\nQ: again", ["Q:", "</s>", "<|im_end|>"]),
        ("no stop here", ["Question:"]),
        ("Question: at the start", ["Question:"]),
        ("cut at </s> or <|im_end|> first", ["<|im_end|>", "</s>"]),
        ("xab", ["b", "ab"]),
        ("xab", ["ab", "b"]),
        ("text<|endoftext|>more", []),
        ("keep all", [""]),
        ("a\n\nb", "\n\n"),
        ("none given", None),
    ]
    out = []
    for text, until in cases:
        stops = handle_stop_sequences(
            list(until) if isinstance(until, list) else until, eos=eos)
        out.append({"text": text, "until": until, "stops": stops,
                    "out": postprocess_generated_text(text, stops, None)})
    return out


def dump(path, obj):
    path.write_text(json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n")


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "train.jsonl").write_text(jsonl(TRAIN))
    (OUT / "test.jsonl").write_text(jsonl(TEST))
    write_yamls()
    os.chdir(ROOT)  # data_files are relative to the repository root
    prompts = {}
    for model in MODELS:
        path = str(ROOT / "tests" / "fixtures" / "models" / model)
        print(f"{model}, batch size 1", flush=True)
        lm = RecordingHFLM(pretrained=path, device="cpu", dtype="float32", batch_size=1)
        runs = run_model(lm, prompts, record=True)
        print(f"{model}, batch size {BATCH}", flush=True)
        lm4 = HFLM(pretrained=path, device="cpu", dtype="float32", batch_size=BATCH)
        runs4 = run_model(lm4, prompts, record=False)
        for key, run in runs.items():
            strip = [{k: v for k, v in d.items() if k != "gen_ids"} for d in run["docs"]]
            run["batch4_same"] = strip == runs4[key]["docs"] and run["results"] == runs4[key]["results"]
            if not run["batch4_same"]:
                print(f"  {key}: batch size {BATCH} differs", flush=True)
        stats = {}
        for key, run in runs.items():
            stats[key] = {f: {"matched": sum(d["filtered"][f] != "[invalid]" for d in run["docs"]),
                              "exact_match": sum(d["exact_match"][f] for d in run["docs"]),
                              "stopped_early": sum(len(d["gen_ids"]) < MAX_GEN_TOKS for d in run["docs"])}
                          for f in run["docs"][0]["filtered"]}
        dump(OUT / f"{model}.json", {"lm_eval": "0.4.13", "model": model, "dtype": "float32",
                                     "max_length": lm.max_length, "runs": runs, "stats": stats})
        del lm, lm4
    dump(OUT / "prompts.json", {"lm_eval": "0.4.13", "seed": SEED, "max_gen_toks": MAX_GEN_TOKS,
                                "runs": prompts})
    dump(OUT / "scripted.json", {"lm_eval": "0.4.13", "templates_per_round": "doc i of round r "
                                 "gets template (i + r) mod n", "tasks": scripted()})
    dump(OUT / "postprocess.json", {"lm_eval": "0.4.13", "eos": "<|endoftext|>",
                                    "cases": postprocess_cases()})
    for p in sorted(OUT.iterdir()):
        h = hashlib.sha256(p.read_bytes()).hexdigest()[:16]
        print(f"{p.relative_to(ROOT)}  {p.stat().st_size:7d}  {h}")


if __name__ == "__main__":
    main()

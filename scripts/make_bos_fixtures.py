#!/usr/bin/env python3
"""Writes tests/fixtures/bos/: what lm-evaluation-harness 0.4.13 (its HF causal-LM backend,
float32 on CPU, batch size 1, `add_bos_token` left unset) does with a tokenizer whose
post-processor adds a BOS token, as Llama's, Mixtral's and DeepSeek's do. The model is
tests/fixtures/models/qwen2_moe with its tokenizer given a `<s>` token (id 300, inside the
model's 304) that a TemplateProcessing post-processor puts first; the harness then encodes
every context with it (the tokenizer's default), and occult eval must too.

- tokenizer.json, tokenizer_config.json: the tokenizer (config.json is the model's with
  bos_token_id 300; the test assembles the folder);
- lmeval.json: per task, the log-likelihoods of arc_easy, piqa and hellaswag (zero-shot, on
  tasks/samples) and the generations of the gsm8k fixture task (on
  tests/fixtures/generative, zero-shot so that the BOS stays in the window, 32 new
  tokens): tokens fed, generated ids, responses, exact
  matches.

Needs lm_eval 0.4.13 with torch and transformers. Run: python3 scripts/make_bos_fixtures.py
(reruns are byte-identical).
"""
import json
import shutil
import sys
import tempfile
from pathlib import Path

from lm_eval.evaluator import evaluate
from lm_eval.tasks import TaskManager

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_generative_fixtures import RecordingHFLM, make_task  # noqa: E402
from make_prompt_fixtures import ROOT, TASKS, harness_tasks  # noqa: E402

MODEL = ROOT / "tests" / "fixtures" / "models" / "qwen2_moe"
OUT = ROOT / "tests" / "fixtures" / "bos"
BOS_ID = 300
CHOICE_TASKS = ["arc_easy", "piqa", "hellaswag"]


def tokenizer():
    t = json.loads((MODEL / "tokenizer.json").read_text())
    assert len(t["model"]["vocab"]) == BOS_ID
    t["added_tokens"].append({"id": BOS_ID, "content": "<s>", "single_word": False,
                              "lstrip": False, "rstrip": False, "normalized": False,
                              "special": True})
    t["post_processor"] = {"type": "Sequence", "processors": [
        t["post_processor"],
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                  {"Sequence": {"id": "A", "type_id": 0}},
                  {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {"<s>": {"id": "<s>", "ids": [BOS_ID], "tokens": ["<s>"]}}},
    ]}
    config = {"bos_token": "<s>", "eos_token": "<|endoftext|>",
              "tokenizer_class": "PreTrainedTokenizerFast"}
    return t, config


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    tok, tok_config = tokenizer()
    (OUT / "tokenizer.json").write_text(json.dumps(tok) + "\n")
    (OUT / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        model.mkdir()
        shutil.copy(MODEL / "model.safetensors", model)
        cfg = json.loads((MODEL / "config.json").read_text())
        cfg["bos_token_id"] = BOS_ID
        (model / "config.json").write_text(json.dumps(cfg))
        shutil.copy(OUT / "tokenizer.json", model)
        shutil.copy(OUT / "tokenizer_config.json", model)
        lm = RecordingHFLM(pretrained=str(model), device="cpu", dtype="float32", batch_size=1)
        probe = lm.tok_encode("Question: hi")
        assert probe[0] == BOS_ID, probe
        out = {"lm_eval": "0.4.13", "bos_token_id": BOS_ID, "tasks": {}}
        tm = TaskManager()
        for name in CHOICE_TASKS:
            splits, _ = TASKS[name]
            ((h, task, ours),) = harness_tasks(tm, name, splits, 0, tmp)
            res = evaluate(lm=lm, task_dict={h: task}, log_samples=True)
            docs = {ours[s["doc_id"]]: [r[0] for r in s["filtered_resps"]]
                    for s in res["samples"][h]}
            out["tasks"][name] = [docs[i] for i in sorted(docs)]
            print(f"{name}: {len(docs)} documents", flush=True)
        task = make_task("gsm8k", 0)
        res = evaluate(lm=lm, task_dict={"gsm8k": task}, log_samples=True)
        docs = {}
        for s in res["samples"]["gsm8k"]:
            (ctx, kw), = s["arguments"]
            d = docs.setdefault(s["doc_id"], {"exact_match": {}})
            ids = lm.tok_encode(ctx)
            fed = ids[-(lm.max_length - kw["max_gen_toks"]):]
            d["input_ids"] = fed
            d["gen_ids"] = lm.generated[tuple(fed)]
            d["resps"] = s["resps"][0][0]
            d["exact_match"][s["filter"]] = float(s["exact_match"])
        out["gsm8k"] = [docs[i] for i in sorted(docs)]
        print(f"gsm8k: {len(docs)} documents", flush=True)
    (OUT / "lmeval.json").write_text(json.dumps(out) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""transformers' side of `occult bench model --against transformers`.

    python scripts/bench_transformers.py MODEL_DIR --dtype f32|bf16|f16 --threads N

Loads the checkpoint with transformers (AutoModelForCausalLM, eager attention), then serves one
JSON request a line on stdin and answers one JSON line on stdout:

    {"prompt": [ids...], "steps": D}
    -> {"prefill_s": s, "decode_s_per_token": s, "logits": [last-position logits of the prompt]}

Each request prefills the prompt and decodes D tokens greedily with the key/value cache, as
occult's bench does, timed here so that the pipe is not counted. The first line written is
{"ready": true, "torch": VERSION, "transformers": VERSION, "isa": LEVEL} once the model is
loaded (LEVEL: AMX, AVX512, AVX2 or DEFAULT; occult caps torch to its own kernels' level with
ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS). occult
carries a copy of this file and runs it with $OCCULT_PYTHON (default python3).
"""
import argparse
import json
import os
import sys
import time
import warnings

import torch
import transformers
from transformers import AutoModelForCausalLM

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def run(model, prompt, steps):
    with torch.inference_mode():
        ids = torch.tensor([prompt], dtype=torch.long)
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        prefill = time.perf_counter() - start
        first = out.logits[0, -1].float()
        past, logits = out.past_key_values, first
        start = time.perf_counter()
        for _ in range(steps):
            nxt = torch.argmax(logits).view(1, 1)
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
        per = (time.perf_counter() - start) / max(steps, 1)
    return {"prefill_s": prefill, "decode_s_per_token": per, "logits": first.tolist()}


def cpu_level():
    """The instruction sets torch's CPU kernels use: ATen's capability (DEFAULT, AVX2, AVX512;
    capped by $ATEN_CPU_CAPABILITY), or AMX where oneDNN may use its tile multiplies for bf16
    (the CPU has them and $ONEDNN_MAX_CPU_ISA does not cap below them)."""
    level = torch.backends.cpu.get_cpu_capability()
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    if level == "AVX512" and amx and (cap == "ALL" or "AMX" in cap):
        return "AMX"
    return level


def main():
    # transformers 5.x warns that `past_key_values` will be renamed; both work for now.
    warnings.filterwarnings("ignore", category=FutureWarning)
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--dtype", default="f32", choices=sorted(DTYPES))
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=DTYPES[a.dtype], attn_implementation="eager")
    model.eval()
    print(json.dumps({"ready": True, "torch": torch.__version__, "transformers": transformers.__version__,
                      "isa": cpu_level()}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        print(json.dumps(run(model, req["prompt"], req["steps"])), flush=True)


if __name__ == "__main__":
    main()

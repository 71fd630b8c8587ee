#!/usr/bin/env python3
"""Regenerate tests/fixtures/finetuned/: what transformers computes on models that `occult train`
fine-tuned from the committed fixtures, so that a test can hold occult's reading of its own
saved checkpoints to transformers' without Python.

    cargo build --release && /tmp/pyenv/bin/python scripts/make_finetuned_fixtures.py [ARCH...]

(every run below, or only the named ones).

For each run below, the script fine-tunes tests/fixtures/models/ARCH with `target/release/occult
train` on tests/fixtures/finetuned/alpaca.jsonl (written here), loads the saved folder with
transformers' `from_pretrained` (no missing or unexpected tensors allowed), and writes ARCH.json
with the run's flags and the logits at every prompt position. The fine-tuned weights are not
committed: the test runs the same command and compares its checkpoint's logits with these. Both
train on the portable kernels (OCCULT_KERNELS=portable), the same on every CPU: AdamW's first
steps turn a kernel's rounding of a near-zero gradient into a step of 2 lr.

The runs cover the three ways a checkpoint keeps its experts and what training can touch:
fused experts with every tensor trained (`--train all`, Qwen2-MoE), per-expert tensors read from
two shards and written as one file under pruning to one device (Qwen3-MoE), Mixtral's
`block_sparse_moe` names with the load-balancing loss and gradient accumulation, and gpt-oss's
fused, interleaved experts with biases (read unquantized, or from MXFP4 and written unquantized). The data seed
is chosen so that no router decision on the prompt is closer than MARGIN after fine-tuning.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_model_fixtures as base  # noqa: E402  (the tokenizer, prompt, hooks and writers)
from transformers import (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Glm4MoeForCausalLM, GptOssForCausalLM,  # noqa: E402
                          MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "finetuned"
OCCULT = ROOT / "target" / "release" / "occult"
COMMON = ["--steps", "4", "--batch-size", "4", "--lr", "1e-2", "--warmup", "0", "--seq-len", "128"]
RUNS = {
    "qwen2_moe": (Qwen2MoeForCausalLM, ["--train", "all", "--devices", "2", "--mode", "occult"]),
    "qwen3_moe": (Qwen3MoeForCausalLM, ["--devices", "2", "--max-devices", "1"]),
    "mixtral": (MixtralForCausalLM, ["--devices", "2", "--aux-loss", "--grad-accum", "2"]),
    # The grouped sigmoid router with its selection bias (kept, untrained), on 4 ranks in 2 nodes.
    "glm4_moe": (Glm4MoeForCausalLM, ["--devices", "4", "--mode", "two-level", "--devices-per-node", "2"]),
    # Latent attention trained too (--train all), on 2 ranks, standard dispatch.
    "deepseek_v3": (DeepseekV3ForCausalLM, ["--train", "all", "--devices", "2", "--mode", "standard"]),
    # Softmax routing with groups kept by their best expert, on 4 ranks, occult dispatch.
    "deepseek_v2": (DeepseekV2ForCausalLM, ["--devices", "4", "--mode", "occult"]),
    # gpt-oss with everything trained (sinks, biases, the biased router), saved fused and
    # interleaved, on 2 ranks, occult dispatch.
    "gpt_oss": (GptOssForCausalLM, ["--train", "all", "--devices", "2", "--mode", "occult"]),
    # gpt-oss read from MXFP4 and saved unquantized (no quantization_config), on 4 ranks.
    "gpt_oss_mxfp4": (GptOssForCausalLM, ["--devices", "4", "--mode", "standard"]),
}


def write_data(path):
    rows = []
    for i in range(12):
        a, b = 3 * i + 1, 7 - i
        if i % 2:
            rows.append({"instruction": f"Add {a} and {b}.", "input": "", "output": str(a + b)})
        else:
            rows.append({"instruction": "Add the numbers.", "input": f"{a} {b}", "output": str(a + b)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main():
    torch.set_num_threads(1)
    if not OCCULT.exists():
        raise SystemExit(f"{OCCULT} is missing: run `cargo build --release` first")
    OUT.mkdir(parents=True, exist_ok=True)
    data = OUT / "alpaca.jsonl"
    write_data(data)
    tok = base.build_tokenizer()
    ids = base.encode(tok, base.PROMPT)
    only = set(sys.argv[1:])
    for arch, (cls, flags) in RUNS.items():
        if only and arch not in only:
            continue
        source = base.OUT / arch
        base_logits = torch.tensor(json.loads((source / "reference.json").read_text())["logits"])
        for seed in range(20):
            args = COMMON + flags + ["--seed", str(seed)]
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "tuned"
                subprocess.run([str(OCCULT), "train", "--model", str(source), "--data", str(data),
                                "--out", str(out)] + args, check=True, capture_output=True,
                               env={**os.environ, "OCCULT_KERNELS": "portable"})
                model, info = cls.from_pretrained(out, output_loading_info=True, attn_implementation="eager",
                                                  experts_implementation="eager")
            assert not any(info.values()), f"{arch}: from_pretrained loading info {info}"
            model = model.eval()
            gaps = []
            handles = base.router_hooks(model, model.config.num_experts_per_tok, gaps)
            logits = base.logits_of(model, ids)
            for h in handles:
                h.remove()
            moved = (logits - base_logits).abs().max().item()
            if min(gaps) >= base.MARGIN:
                break
            print(f"  {arch}: seed {seed} rejected (routing gap {min(gaps):.2e})")
        else:
            raise SystemExit(f"{arch}: no data seed gives clear routing")
        ref = {"args": args, "input_ids": ids,
               "logits": [[float(f"{v:.7g}") for v in row] for row in logits.tolist()],
               "moved": moved}
        base.dump_reference(OUT / f"{arch}.json", ref)
        print(f"{arch}: {' '.join(args)}: routing gap {min(gaps):.2e}, logits moved by up to {moved:.3f}")


if __name__ == "__main__":
    main()

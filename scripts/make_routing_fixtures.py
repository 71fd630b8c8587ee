#!/usr/bin/env python3
"""Regenerate tests/fixtures/routing/: routing recorded outside Occult, for `occult trace import`.

    /work/venv/bin/python scripts/make_routing_fixtures.py      (from the repository root)

Needs torch, transformers, safetensors and numpy. Writes:
- calib.txt: a few lines of text;
- olmoe_hook.safetensors: scripts/record_routing.py on the OLMoE fixture over calib.txt
  (--seq-len 32 --max-tokens 96 --logits): tests/tests/routing_import.rs checks it equals
  `occult profile`'s trace of the same text;
- the same routing as plain arrays, written by numpy and safetensors as a user would:
  per_layer.npz (np.savez, int64 `layers.L.topk_ids` and float32 `layers.L.topk_weights`),
  stacked_padded.npz (np.savez_compressed, int32 `topk_ids` [layers, tokens + 1, 8] padded with -1
  as SGLang's per_token recorder pads: a padded token row and columns past the top-k, with
  `layer_ids`), stacked.npy (int64 [layers, tokens, k]) and stacked.safetensors (int32 `topk_ids`,
  `layer_ids`, float16 `router_logits`);
- sglang_per_token.pt: the same routing as SGLang's per_token expert-distribution dump holds it
  (sglang 0.5.23, `_DetailAccumulator.dump`: a torch.save of {"records": [...],
  "last_physical_to_logical_map": [layers, physical]}, each record's `topk_ids_of_layer` int32
  [layers, tokens, 8] of *physical* ids, -1 padded), in two forward passes, with a fourth layer
  that recorded nothing (as a dense layer) and a permuted physical-to-logical map.
"""
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file as save_np
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "routing"
TEXT = """Light from the sun takes about eight minutes to reach the earth.
Bread needs flour, water, salt and yeast, and the dough must rest before it is baked.
The weather in the mountains can change quickly, so hikers carry warm clothes and a map.
Hello world is the first program that many people write when they learn to code.
"""


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "calib.txt").write_text(TEXT)
    hook = OUT / "olmoe_hook.safetensors"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "record_routing.py"), "--model",
                    str(ROOT / "tests" / "fixtures" / "models" / "olmoe"), "--data", str(OUT / "calib.txt"),
                    "-o", str(hook), "--seq-len", "32", "--max-tokens", "96", "--logits"], check=True)
    t = load_file(hook)
    layers = sorted(int(k.split(".")[1]) for k in t if k.endswith("topk_ids"))
    ids = np.stack([t[f"layers.{l}.topk_ids"].numpy() for l in layers])          # [L, T, k]
    weights = np.stack([t[f"layers.{l}.topk_weights"].numpy() for l in layers])
    logits = np.stack([t[f"layers.{l}.router_logits"].numpy() for l in layers])
    np.savez(OUT / "per_layer.npz", **{f"layers.{l}.topk_ids": ids[i].astype(np.int64) for i, l in enumerate(layers)},
             **{f"layers.{l}.topk_weights": weights[i] for i, l in enumerate(layers)})
    n_l, n_t, k = ids.shape
    padded = np.full((n_l, n_t + 1, 8), -1, dtype=np.int32)
    padded[:, :5, :k] = ids[:, :5]          # tokens 0-4, then a padded row, then the rest
    padded[:, 6:, :k] = ids[:, 5:]
    np.savez_compressed(OUT / "stacked_padded.npz", topk_ids=padded, layer_ids=np.array(layers))
    np.save(OUT / "stacked.npy", ids.astype(np.int64))
    save_np({"topk_ids": ids.astype(np.int32), "layer_ids": np.array(layers, dtype=np.int64),
             "router_logits": logits.astype(np.float16)}, str(OUT / "stacked.safetensors"))
    # SGLang: physical slot p of layer l holds logical expert phys_to_log[l][p].
    e = 8
    gen = torch.Generator().manual_seed(0)
    phys_to_log = torch.stack([torch.randperm(e, generator=gen) for _ in range(n_l + 1)])
    log_to_phys = phys_to_log.argsort(dim=1)
    physical = np.full((n_l + 1, n_t, 8), -1, dtype=np.int32)
    for l in range(n_l):
        physical[l, :, :k] = log_to_phys[l][torch.from_numpy(ids[l].astype(np.int64))].numpy()
    def record(i, part):
        return {"forward_pass_id": i, "rank": 0, "gatherer_key": "primary", "input_ids": [0] * part.shape[1],
                "positions": list(range(part.shape[1])), "extend_seq_lens": [part.shape[1]], "forward_mode": 1,
                "topk_ids_of_layer": torch.from_numpy(part.copy()), "misc_objects": [],
                "global_physical_count": torch.zeros(n_l + 1, e, dtype=torch.int32)}
    pad = np.full((n_l + 1, 1, 8), -1, dtype=np.int32)  # a padded token row in the second pass
    second = np.concatenate([physical[:, 40:41], pad, physical[:, 41:]], axis=1)
    torch.save({"records": [record(0, physical[:, :40]), record(1, second)],
                "last_physical_to_logical_map": phys_to_log}, OUT / "sglang_per_token.pt")
    print(f"wrote {OUT}: {n_l} layers x {n_t} tokens, top-{k}")


if __name__ == "__main__":
    main()

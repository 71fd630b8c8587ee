#!/usr/bin/env python3
"""Record a transformers MoE model's routing on a text file, straight into an Occult trace.

    python scripts/record_routing.py --model allenai/OLMoE-1B-7B-0924 --data calib.txt \\
        -o trace.safetensors [--seq-len 512] [--max-tokens N] [--logits] [--device cuda] \\
        [--dtype bfloat16] [--add-bos] [--trust-remote-code]

For users who already run the model in PyTorch (on GPUs): the trace is what `occult profile`
writes (format occult.trace.v1, docs/formats.md), so `occult collab`, `occult place` and
`occult export` take it as it is. The text is cut as `occult profile` cuts it: one document per
non-empty line (or the `text` field of each JSON line of a .jsonl file), each tokenised alone
(without special tokens; with the BOS token first under --add-bos) and cut into windows of
--seq-len tokens, until --max-tokens.

It hooks every MoE router, `model.layers.L.{mlp,block_sparse_moe}.gate`, and keeps the experts
the router chose for each token, best first (by gate weight; by sigmoid score plus
`e_score_correction_bias` where the router has one), with their gate weights and,
under --logits, the router's logits. transformers v5 routers return (logits, weights, ids);
DeepSeek-MoE v1's remote code returns (ids, weights, aux_loss): both are read. Needs torch,
transformers and safetensors.
"""
import argparse
import json
import os
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

ROUTER = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate")


def documents(path):
    text = Path(path).read_text(encoding="utf-8")
    jsonl = path.endswith((".jsonl", ".json"))
    docs = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        if jsonl:
            v = json.loads(line)
            if not isinstance(v.get("text"), str):
                sys.exit(f"{path} line {i + 1}: no string field `text`")
            docs.append(v["text"])
        else:
            docs.append(line)
    if not docs:
        sys.exit(f"{path}: no documents")
    return docs


def windows(tok, docs, seq_len, max_tokens, add_bos):
    out, total = [], 0
    for d in docs:
        ids = tok.encode(d, add_special_tokens=False)
        if add_bos and tok.bos_token_id is not None:
            ids = [tok.bos_token_id] + ids
        for s in range(0, len(ids), seq_len):
            w = ids[s:s + seq_len]
            if max_tokens is not None:
                w = w[:max_tokens - total]
            if not w:
                return out
            out.append(w)
            total += len(w)
    return out


def routing_of(output, num_experts):
    """(ids [T, k], weights [T, k], logits [T, E] or None) from a router's output tuple."""
    parts = output if isinstance(output, (tuple, list)) else (output,)
    tensors = [p for p in parts if torch.is_tensor(p)]
    ids = next((p for p in tensors if not p.is_floating_point() and p.dim() == 2), None)
    if ids is None:
        raise SystemExit("a router's output holds no [tokens, k] integer ids: not a router this script reads")
    weights = next((p for p in tensors if p.is_floating_point() and p.shape == ids.shape), None)
    logits = next((p for p in tensors if p.is_floating_point() and p.dim() == 2
                   and p.shape[-1] == num_experts and p.shape[0] == ids.shape[0]), None)
    return ids, weights, logits


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model folder or hub id")
    p.add_argument("--data", required=True, help="text (one document per line) or .jsonl with `text`")
    p.add_argument("-o", "--output", required=True, help="the trace to write (.safetensors)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--logits", action="store_true", help="also store router logits (for pruning)")
    p.add_argument("--add-bos", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--trust-remote-code", action="store_true")
    a = p.parse_args()
    if a.seq_len < 1 or (a.max_tokens is not None and a.max_tokens < 1):
        sys.exit("--seq-len and --max-tokens must be at least 1")

    tok = AutoTokenizer.from_pretrained(a.model, trust_remote_code=a.trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype),
                                                 trust_remote_code=a.trust_remote_code).to(a.device).eval()
    cfg = model.config
    num_experts = next(getattr(cfg, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                       if getattr(cfg, k, None))
    top_k = cfg.num_experts_per_tok
    seen = {}

    def hook(layer):
        def record(module, inputs, output):
            ids, weights, logits = routing_of(output, num_experts)
            # Best first, as Occult's traces keep them: by the selection score, which is the gate
            # weight except where a bias steers selection only (DeepSeek-V3's
            # e_score_correction_bias on sigmoid scores).
            bias = getattr(module, "e_score_correction_bias", None)
            if logits is not None and torch.is_tensor(bias):
                score = (logits.float().sigmoid() + bias.float()).gather(-1, ids.long())
            else:
                score = weights.float() if weights is not None else None
            if score is not None:
                order = score.argsort(dim=-1, descending=True, stable=True)
                ids = ids.gather(-1, order)
                weights = weights.float().gather(-1, order) if weights is not None else None
            r = seen.setdefault(layer, {"ids": [], "weights": [], "logits": []})
            r["ids"].append(ids.to("cpu", torch.int32))
            if weights is not None:
                r["weights"].append(weights.to("cpu", torch.float32))
            if a.logits and logits is not None:
                r["logits"].append(logits.to("cpu", torch.float32))
        return record

    hooks = [m.register_forward_hook(hook(int(ROUTER.fullmatch(n)[1])))
             for n, m in model.named_modules() if ROUTER.fullmatch(n)]
    if not hooks:
        sys.exit(f"{a.model}: no MoE routers (modules named layers.L.mlp.gate or layers.L.block_sparse_moe.gate)")
    ws = windows(tok, documents(a.data), a.seq_len, a.max_tokens, a.add_bos)
    if not ws:
        sys.exit(f"{a.data}: the documents hold no tokens")
    with torch.no_grad():
        for w in ws:
            model(input_ids=torch.tensor([w], device=a.device), use_cache=False)
    for h in hooks:
        h.remove()

    tensors = {}
    for layer, r in sorted(seen.items()):
        tensors[f"layers.{layer}.topk_ids"] = torch.cat(r["ids"]).contiguous()
        if r["weights"]:
            tensors[f"layers.{layer}.topk_weights"] = torch.cat(r["weights"]).contiguous()
        if r["logits"]:
            tensors[f"layers.{layer}.router_logits"] = torch.cat(r["logits"]).contiguous()
    meta = {"format": "occult.trace.v1", "num_experts": str(num_experts), "top_k": str(top_k),
            "model": a.model, "data": a.data, "recorded_by": "scripts/record_routing.py"}
    tmp = f"{a.output}.tmp-{os.getpid()}"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, a.output)  # never a half-written trace in place of a good one
    n = sum(len(w) for w in ws)
    print(f"wrote {a.output}: {len(seen)} MoE layers x {n} tokens, {num_experts} experts, top-{top_k}")


if __name__ == "__main__":
    main()

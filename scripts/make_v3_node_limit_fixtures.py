#!/usr/bin/env python3
"""Regenerate tests/fixtures/routing/v3_node_limit.json: transformers' DeepSeek-V3 router.

    python scripts/make_v3_node_limit_fixtures.py      (from the repository root)

Needs torch and transformers (5.x). For each case, transformers' own `DeepseekV3TopkRouter`
(sigmoid scores, `e_score_correction_bias` for selection, `n_group` expert groups scored by the
sum of their best two, the best `topk_group` groups kept, top-k inside them, renormalised and
scaled) routes seeded hidden states with a seeded weight and bias; the fixture keeps the router
logits, the bias and the chosen experts with their weights. Occult's node limit
(`--max-nodes M`, `occult-core/src/analysis/pruning.rs`) on a contiguous placement whose nodes
are V3's groups must choose the same experts with the same weights.
"""
import json
from pathlib import Path

import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter


def main():
    torch.manual_seed(2026)
    # (experts, top-k, groups, groups kept, tokens)
    shapes = [(16, 4, 4, 1, 64), (16, 4, 4, 2, 64), (32, 8, 8, 4, 64), (64, 6, 4, 2, 64)]
    cases = []
    for experts, k, groups, kept, tokens in shapes:
        config = DeepseekV3Config(
            hidden_size=16,
            n_routed_experts=experts,
            num_experts_per_tok=k,
            n_group=groups,
            topk_group=kept,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        )
        router = DeepseekV3TopkRouter(config)
        with torch.no_grad():
            router.weight.normal_(0.0, 1.0)
            router.e_score_correction_bias.uniform_(-0.2, 0.2)
            hidden = torch.randn(tokens, 16)
            logits, weights, ids = router(hidden)
        order = ids.sort(dim=-1)
        cases.append({
            "experts": experts,
            "top_k": k,
            "groups": groups,
            "groups_kept": kept,
            "scaling": 2.5,
            "bias": router.e_score_correction_bias.tolist(),
            "logits": logits.tolist(),
            "ids": order.values.tolist(),
            "weights": weights.gather(1, order.indices).tolist(),
        })
    import transformers

    out = {
        "source": f"transformers {transformers.__version__}, DeepseekV3TopkRouter "
                  "(scripts/make_v3_node_limit_fixtures.py)",
        "cases": cases,
    }
    path = Path("tests/fixtures/routing/v3_node_limit.json")
    path.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {path}: {len(cases)} cases")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Regenerate tests/fixtures/eplb/cases.json: DeepSeek's published EPLB run on a few load vectors.

    /work/venv/bin/python scripts/make_eplb_fixtures.py EPLB_DIR      (from the repository root)

EPLB_DIR holds `eplb.py` from github.com/deepseek-ai/EPLB (not part of this repository: fetch it,
and give the commit with --commit so the fixture records it). Needs torch. Each case is one
`rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)` call on seeded
integer loads (token counts: Zipf-like, so a few hot experts, and some with ties); the fixture
keeps its inputs and the published code's `physical_to_logical_map` and `expert_count`. The
Rust port (`occult-core/src/analysis/placement/eplb.rs`) must give the same, per layer.
"""
import argparse
import json
import random
import sys
from pathlib import Path


def loads(rng, layers, experts, skew, ties):
    out = []
    for _ in range(layers):
        row = [max(1, int(1000 / (r + 1) ** skew * rng.uniform(0.5, 1.5))) for r in range(experts)]
        rng.shuffle(row)
        if ties:
            # Copy a few values onto other experts, so that equal loads meet in the sorts.
            for _ in range(experts // 4):
                row[rng.randrange(experts)] = row[rng.randrange(experts)]
        out.append(row)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("eplb_dir")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", default="tests/fixtures/eplb/cases.json")
    a = ap.parse_args()
    sys.path.insert(0, a.eplb_dir)
    import torch
    import eplb

    rng = random.Random(2025)
    # (experts, physical, groups, nodes, gpus, skew, ties): hierarchical where the groups
    # divide over the nodes, global otherwise.
    shapes = [
        (16, 20, 4, 2, 4, 1.0, False),
        (16, 24, 4, 3, 6, 1.2, False),
        (64, 72, 8, 2, 8, 1.0, False),
        (64, 72, 8, 2, 8, 0.8, True),
        (64, 80, 1, 1, 16, 1.5, False),
        (64, 96, 3, 2, 16, 1.0, True),
        (128, 144, 8, 4, 16, 1.1, False),
        (8, 8, 2, 1, 4, 1.0, False),
    ]
    cases = []
    for experts, physical, groups, nodes, gpus, skew, ties in shapes:
        w = loads(rng, 3, experts, skew, ties)
        phy2log, log2phy, logcnt = eplb.rebalance_experts(
            torch.tensor(w, dtype=torch.int64), physical, groups, nodes, gpus
        )
        cases.append({
            "loads": w,
            "physical": physical,
            "groups": groups,
            "nodes": nodes,
            "gpus": gpus,
            "hierarchical": groups % nodes == 0,
            "phy2log": phy2log.tolist(),
            "logcnt": logcnt.tolist(),
        })
    doc = {
        "made_by": "scripts/make_eplb_fixtures.py",
        "eplb": f"github.com/deepseek-ai/EPLB eplb.py at {a.commit}",
        "torch": torch.__version__,
        "cases": cases,
    }
    Path(a.out).write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    print(f"wrote {len(cases)} cases to {a.out}")


if __name__ == "__main__":
    main()

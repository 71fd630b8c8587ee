#!/usr/bin/env python3
"""Regenerate tests/fixtures/sglang/dispatch.json: SGLang's own static dispatch tables.

    python scripts/make_sglang_dispatch_fixtures.py SGLANG_DIR      (from the repository root)

SGLANG_DIR holds the `sglang` package of sglang 0.5.23 (unzip the wheel from PyPI:
`pip download --no-deps sglang==0.5.23`; only `sglang/srt/eplb/expert_location.py` is read).
Needs torch. The module is loaded as it is, with only the server's state stubbed
(`sglang.srt.runtime_context`: the a2a backend, the dispatch algorithm "static", the EP size
and the node count). For each case (a location file's rows, the EP size, the nodes) and each
rank, the script runs `ExpertLocationMetadata.init_by_mapping`'s two steps as SGLang runs them
on that rank, `_compute_logical_to_all_physical_map` then
`compute_logical_to_rank_dispatch_physical_map`, and keeps the rank's table: `[layer][logical
expert]`, the physical slot the rank sends the expert's tokens to. The Rust port
(`occult-core/src/analysis/placement/sglang_dispatch.rs`) must give the same.
"""
import argparse
import importlib.util
import json
import random
import sys
import types
from pathlib import Path


class _Moe:
    def __init__(self):
        self.moe_a2a_backend = "deepep"
        self.ep_dispatch_algorithm = "static"
        self.ep_join_mode = "none"


class _Exec:
    def __init__(self):
        self.moe = _Moe()


class _Parallel:
    def __init__(self, ep_size, nnodes):
        self.ep_size = ep_size
        self.nnodes = nnodes


STATE = {"exec": _Exec(), "parallel": _Parallel(1, 1)}


def load_expert_location(sglang_dir):
    rc = types.ModuleType("sglang.srt.runtime_context")
    rc.get_exec = lambda: STATE["exec"]
    rc.get_parallel = lambda: STATE["parallel"]
    rc.get_device = lambda: None
    rc.get_resources = lambda: None
    sys.modules["sglang.srt.runtime_context"] = rc
    # The elastic-EP check `_prefer_same_node_experts` imports: not elastic here.
    elastic = types.ModuleType("sglang.srt.elastic_ep.elastic_ep")
    elastic.elastic_expanded_world_enabled = lambda: False
    sys.modules["sglang.srt.elastic_ep.elastic_ep"] = elastic
    path = Path(sglang_dir) / "sglang/srt/eplb/expert_location.py"
    spec = importlib.util.spec_from_file_location("sglang_expert_location", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def tables(mod, rows, num_logical, ep_size, nnodes):
    import torch

    STATE["parallel"] = _Parallel(ep_size, nnodes)
    p2l = torch.tensor(rows)
    out = []
    for rank in range(ep_size):
        l2all = mod._compute_logical_to_all_physical_map(
            physical_to_logical_map=p2l,
            num_logical_experts=num_logical,
            ep_size=ep_size,
            moe_ep_rank=rank,
        )
        # `_init_raw` pads to the physical width before the table is built.
        width = p2l.shape[1]
        l2all = torch.nn.functional.pad(l2all, (0, width - l2all.shape[-1]), value=-1)
        t = mod.compute_logical_to_rank_dispatch_physical_map(
            logical_to_all_physical_map=l2all,
            ep_size=ep_size,
            num_physical_experts=width,
            ep_rank=rank,
        )
        out.append(t.tolist())
    return out


def random_rows(rng, layers, experts, ep_size, replicas, dense_first, twice):
    width = experts + replicas
    rows = []
    for layer in range(layers):
        if layer < dense_first:
            rows.append([p % experts for p in range(width)])
            continue
        extra = [rng.randrange(experts) for _ in range(replicas)]
        slots = list(range(experts)) + extra
        rng.shuffle(slots)
        if not twice:
            # Keep every GPU free of an expert twice, as Occult writes them.
            per = width // ep_size
            for _ in range(1000):
                bad = [
                    i for i in range(width)
                    if slots[i] in slots[(i // per) * per:i]
                ]
                if not bad:
                    break
                j = rng.randrange(width)
                slots[bad[0]], slots[j] = slots[j], slots[bad[0]]
        rows.append(slots)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sglang_dir")
    ap.add_argument("--out", default="tests/fixtures/sglang/dispatch.json")
    a = ap.parse_args()
    mod = load_expert_location(a.sglang_dir)
    rng = random.Random(2026)
    # (layers, experts, ep_size, replicas, nnodes, dense layers first, twice on one GPU)
    shapes = [
        (3, 8, 4, 4, 1, 0, False),
        (4, 16, 4, 8, 1, 1, False),
        (3, 16, 8, 8, 1, 0, False),
        (2, 12, 8, 4, 1, 0, False),
        (3, 16, 8, 16, 2, 0, False),
        (2, 32, 16, 16, 4, 1, False),
        (2, 8, 4, 8, 1, 0, True),
        (2, 16, 4, 0, 1, 0, False),
    ]
    cases = []
    for layers, experts, ep, replicas, nnodes, dense, twice in shapes:
        rows = random_rows(rng, layers, experts, ep, replicas, dense, twice)
        cases.append({
            "num_logical": experts,
            "ep_size": ep,
            "nnodes": nnodes,
            "rows": rows,
            "tables": tables(mod, rows, experts, ep, nnodes),
        })
    out = {
        "source": "sglang 0.5.23, srt/eplb/expert_location.py, moe_a2a_backend deepep, "
                  "ep_dispatch_algorithm static (scripts/make_sglang_dispatch_fixtures.py)",
        "cases": cases,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {a.out}: {len(cases)} cases")


if __name__ == "__main__":
    main()

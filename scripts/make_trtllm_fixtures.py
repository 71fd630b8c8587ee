#!/usr/bin/env python3
"""Regenerate tests/fixtures/trtllm/cooccurrence.json: TensorRT-LLM's co-occurrence placement.

    python scripts/make_trtllm_fixtures.py TRTLLM_DIR      (from the repository root)

TRTLLM_DIR is a checkout of github.com/NVIDIA/TensorRT-LLM (not part of this repository); the
script reads two files of it as they are:

- `cpp/tensorrt_llm/runtime/moeLoadBalancer/moeLoadBalancer.cpp`: its `doReplication` function is
  cut out whole and compiled with g++ against two stub structs (the fields it reads), then run;
- `examples/wide_ep/ep_load_balancer/utils.py`: `do_placement_with_cooccurrence`, imported
  (its file-reading helpers' modules, safetensors and yaml, stubbed when absent).

Needs torch and g++. Each case is one layer's seeded routing (top-k ids): the expert loads are its
token counts and the co-occurrence its pair counts with the diagonal masked at -1e9, as
`generate_eplb_config_cooccurrence.py` builds them; the fixture keeps the routing, the replica
counts and each rank's experts. The Rust port
(`occult-core/src/analysis/placement/cooccurrence.rs`) must give the same.
"""
import argparse
import importlib.util
import json
import random
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

HARNESS = r"""
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <queue>
#include <utility>
#include <vector>
namespace tensorrt_llm::kernels {
struct MoeLoadBalanceMetaInfo { int expertCount; int topK; int epRank; int epSize; int slotCountPerRank; };
}
namespace tensorrt_llm::runtime {
struct MoePlacementCpuInfo { std::vector<int> expertReplicaCount; };
%s
}
int main() {
    tensorrt_llm::kernels::MoeLoadBalanceMetaInfo m{};
    if (std::scanf("%%d %%d %%d", &m.expertCount, &m.epSize, &m.slotCountPerRank) != 3) return 1;
    std::vector<float> load(m.expertCount);
    for (auto& x : load) if (std::scanf("%%f", &x) != 1) return 1;
    tensorrt_llm::runtime::MoePlacementCpuInfo p;
    tensorrt_llm::runtime::doReplication(m, load.data(), &p);
    for (int c : p.expertReplicaCount) std::printf("%%d ", c);
    return 0;
}
"""


def cut_function(text, head):
    start = text.index(head)
    depth, i = 0, text.index("{", start)
    while True:
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
        i += 1


def build_replication(trt):
    cpp = (Path(trt) / "cpp/tensorrt_llm/runtime/moeLoadBalancer/moeLoadBalancer.cpp").read_text()
    fn = cut_function(cpp, "void doReplication(")
    tmp = Path(tempfile.mkdtemp())
    (tmp / "h.cpp").write_text(HARNESS % fn)
    subprocess.run(["g++", "-std=c++17", "-O1", "-o", str(tmp / "h"), str(tmp / "h.cpp")], check=True)
    return tmp / "h"


def replication(exe, loads, ep_size, per_rank):
    inp = f"{len(loads)} {ep_size} {per_rank}\n" + " ".join(repr(float(x)) for x in loads)
    out = subprocess.run([str(exe)], input=inp, capture_output=True, text=True, check=True)
    return [int(x) for x in out.stdout.split()]


def load_utils(trt):
    for name in ["safetensors", "safetensors.torch", "yaml"]:
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = types.ModuleType(name)
    sys.modules["safetensors"].torch = sys.modules["safetensors.torch"]
    path = Path(trt) / "examples/wide_ep/ep_load_balancer/utils.py"
    spec = importlib.util.spec_from_file_location("trtllm_eplb_utils", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def routing(rng, tokens, experts, k, skew):
    weights = [1.0 / (r + 1) ** skew for r in range(experts)]
    rng.shuffle(weights)
    # Clusters of experts that tokens prefer together.
    clusters = [list(range(c, experts, 4)) for c in range(4)]
    ids = []
    for _ in range(tokens):
        home = clusters[rng.randrange(4)]
        w = [weights[e] * (3.0 if e in home else 1.0) for e in range(experts)]
        chosen = []
        while len(chosen) < k:
            e = rng.choices(range(experts), weights=w)[0]
            if e not in chosen:
                chosen.append(e)
        ids.extend(chosen)
    return ids


def main():
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("trtllm_dir")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", default="tests/fixtures/trtllm/cooccurrence.json")
    a = ap.parse_args()
    exe = build_replication(a.trtllm_dir)
    utils = load_utils(a.trtllm_dir)
    rng = random.Random(2026)
    # (tokens, experts, k, ep_size, replicas, skew)
    shapes = [
        (300, 16, 4, 4, 0, 1.0),
        (300, 16, 4, 4, 4, 1.0),
        (400, 32, 4, 8, 8, 1.2),
        (400, 32, 2, 4, 8, 0.8),
        (300, 24, 4, 8, 8, 1.5),
        (500, 64, 8, 8, 8, 1.0),
        (300, 12, 2, 4, 4, 0.5),
    ]
    cases = []
    for tokens, experts, k, ep, replicas, skew in shapes:
        ids = routing(rng, tokens, experts, k, skew)
        t = torch.tensor(ids).view(-1, k)
        loads = torch.bincount(t.flatten(), minlength=experts).float()
        hot = torch.zeros(t.shape[0], experts)
        hot.scatter_(1, t, 1.0)
        cooc = hot.T @ hot
        eye = torch.arange(experts)
        cooc = cooc.masked_fill(eye.unsqueeze(1) == eye, -1e9)
        per_rank = (experts + replicas) // ep
        counts = replication(exe, loads.tolist(), ep, per_rank)
        ranks = utils.do_placement_with_cooccurrence(
            loads, torch.tensor(counts), cooc, ep_size=ep, alpha=0.8)
        cases.append({
            "experts": experts, "k": k, "ep_size": ep, "replicas": replicas,
            "ids": ids, "replica_counts": counts, "ranks": ranks,
        })
    out = {
        "source": f"TensorRT-LLM {a.commit}: doReplication (moeLoadBalancer.cpp) and "
                  "do_placement_with_cooccurrence (examples/wide_ep/ep_load_balancer/utils.py), "
                  "alpha 0.8 (scripts/make_trtllm_fixtures.py)",
        "cases": cases,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {a.out}: {len(cases)} cases")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Regenerate tests/fixtures/trtllm/expert_statistic/: a dump written by TensorRT-LLM's own writer.

    python scripts/make_trtllm_statistic_fixtures.py \\
        EXPERT_STATISTIC_PY [COOCCURRENCE_EXPERT_STATISTIC_PY]       (from the repository root)

Both arguments are copies of TensorRT-LLM's `tensorrt_llm/_torch/expert_statistic.py` (the
file that writes the dump when `EXPERT_STATISTIC_ITER_RANGE=start-stop` and
`EXPERT_STATISTIC_PATH=DIR` are set), read as they are; neither is part of this repository:

- EXPERT_STATISTIC_PY, the plain writer: github.com/NVIDIA/TensorRT-LLM at commit
  0fccc5b97dd7b23c438e740b3bf4dcde607266c4, `tensorrt_llm/_torch/expert_statistic.py`
  (3,556 characters; `git show 0fccc5b9:tensorrt_llm/_torch/expert_statistic.py` in a clone, or
  https://raw.githubusercontent.com/NVIDIA/TensorRT-LLM/0fccc5b97dd7b23c438e740b3bf4dcde607266c4/tensorrt_llm/_torch/expert_statistic.py).
  It writes `meta_info.json` (rank 0) and `rank{R}.safetensors`: `"{iter}_{layer}"` -> the
  tokens per expert, `torch.bincount` of the ids, so int64.
- COOCCURRENCE_EXPERT_STATISTIC_PY, the co-occurrence writer that
  `examples/wide_ep/ep_load_balancer/generate_eplb_config_cooccurrence.py` reads: the same
  repository (not a fork) at commit da2d61087272dfa5ae2981aaeeaffc37de825a5c, same path
  (4,925 characters). It writes the same two files (its counts cast to int32) and, per rank,
  `cooccurrence_rank{R}.safetensors` (`[E, E]` int32 pair counts) and
  `token_selected_experts_rank{R}.safetensors` (`[tokens, top_k]` ids as given, int32 here).

Needs torch and safetensors (CPU). Stubbed, as having no meaning off a GPU server: the
`tensorrt_llm` package around the file (`tensorrt_llm.logger.logger`, whose `info` prints to
stderr, and `tensorrt_llm.envs.get_env`, which reads os.environ with TensorRT-LLM's default
`EXPERT_STATISTIC_PATH=expert_statistic`); `safetensors.torch` is imported first because the
files only `import safetensors` and rely on TensorRT-LLM having imported the submodule. Nothing
CUDA is called by either file: the ids are CPU tensors, so `.cpu()` and `device=` are no-ops.

Each rank is a process in TensorRT-LLM, so each rank gets a freshly loaded module (its
`ExpertStatistic.expert_statistic_obj` singleton is per process). The calls are TensorRT-LLM's,
in its order: `PyTorchModelEngine.__init__` calls `ExpertStatistic.create(dist.rank)`; each
forward step first calls `ExpertStatistic.set_iter(iter_counter)` (from the CUDA-graph check,
`_maybe_get_cuda_graph`), then each MoE layer, in model order, calls
`ExpertStatistic.set_layer(self.layer_idx)` and
`ExpertStatistic.maybe_add_info(self.num_slots, token_selected_slots)` (fused_moe's forward,
once per chunk, chunk after chunk, when the layer splits its tokens into chunks; no load
balancer, so the slots are the expert ids and num_slots the expert count; the ids are int32, as
fused_moe asserts). The range is
100-103: step 99 is before it (not recorded), steps 100..102 are recorded, and step 103's
`set_iter` writes the files. 2 ranks with their own tokens (attention DP), MoE layers 1 and 3,
16 experts, top-4, 2-5 tokens a rank a step, seeded; rank 1's step 101 runs its MoE in two
chunks, exercising the writer's concatenation.

With both files the co-occurrence writer's dump is the fixture folder, and the plain writer's
dump (made in a temporary folder from the same calls) is checked to hold the same meta, keys and
counts. With the plain file alone the folder holds the plain dump (no token ids). The expected
JSON is built from the seeded routing, not from the dump: per layer the ids joined as Occult's
reader joins them (iterations ascending, within one ranks ascending) and the counts per expert
summed over iterations and ranks.
"""
import argparse
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile
import types
from pathlib import Path

NUM_EXPERTS = 16
TOP_K = 4
RANKS = 2
LAYERS = [1, 3]
START, STOP = 100, 103
STEPS = range(START - 1, STOP + 1)  # 99 (before the range) .. 103 (writes the dump)
CHUNKED = {(1, 101)}  # (rank, step) whose MoE runs in two chunks


class _Logger:
    def info(self, msg):
        print(f"[trtllm] {msg}", file=sys.stderr)

    warning = error = debug = info


def _stub_tensorrt_llm():
    pkg = types.ModuleType("tensorrt_llm")
    pkg.__path__ = []
    logger_mod = types.ModuleType("tensorrt_llm.logger")
    logger_mod.logger = _Logger()
    envs = types.ModuleType("tensorrt_llm.envs")
    defaults = {"EXPERT_STATISTIC_PATH": "expert_statistic"}
    envs.get_env = lambda name: os.environ.get(name, defaults.get(name))
    pkg.logger = logger_mod
    pkg.envs = envs
    sys.modules["tensorrt_llm"] = pkg
    sys.modules["tensorrt_llm.logger"] = logger_mod
    sys.modules["tensorrt_llm.envs"] = envs


def load_fresh(path, name):
    """The file as a new module: one rank's process."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def routing(seed=2026):
    """{(rank, step, layer): [chunk, ...]}, each chunk a list of tokens' top-k ids."""
    rng = random.Random(seed)
    out = {}
    for rank in range(RANKS):
        for step in STEPS:
            tokens = rng.randint(2, 5)
            for layer in LAYERS:
                ids = [rng.sample(range(NUM_EXPERTS), TOP_K) for _ in range(tokens)]
                if (rank, step) in CHUNKED:
                    cut = tokens // 2
                    out[(rank, step, layer)] = [ids[:cut], ids[cut:]]
                else:
                    out[(rank, step, layer)] = [ids]
    return out


def drive(path, dump_dir, routes, tag):
    """Every rank through TensorRT-LLM's calls, writing to dump_dir."""
    import torch

    os.environ["EXPERT_STATISTIC_ITER_RANGE"] = f"{START}-{STOP}"
    os.environ["EXPERT_STATISTIC_PATH"] = str(dump_dir)
    for rank in range(RANKS):
        ES = load_fresh(path, f"trtllm_expert_statistic_{tag}_rank{rank}").ExpertStatistic
        ES.create(rank)  # PyTorchModelEngine.__init__
        for step in STEPS:
            ES.set_iter(step)  # the CUDA-graph check at the start of the forward step
            for layer in LAYERS:  # the model's MoE layers in order
                for ids in routes[(rank, step, layer)]:  # fused_moe's forward, per chunk
                    ES.set_layer(layer)
                    ES.maybe_add_info(NUM_EXPERTS, torch.tensor(ids, dtype=torch.int32))


def expected(routes):
    layers = {}
    for layer in LAYERS:
        ids, counts = [], [0] * NUM_EXPERTS
        for step in range(START, STOP):
            for rank in range(RANKS):
                for chunk in routes[(rank, step, layer)]:
                    for tok in chunk:
                        ids.append(tok)
                        for e in tok:
                            counts[e] += 1
        layers[str(layer)] = {"topk_ids": ids, "counts": counts}
    return {
        "source": "TensorRT-LLM tensorrt_llm/_torch/expert_statistic.py, range "
                  f"{START}-{STOP}, {RANKS} ranks (scripts/make_trtllm_statistic_fixtures.py)",
        "num_experts": NUM_EXPERTS,
        "top_k": TOP_K,
        "layers": layers,
    }


def describe(dump_dir):
    from safetensors import safe_open

    for f in sorted(Path(dump_dir).iterdir()):
        if f.suffix == ".json":
            print(f"  {f.name}: {f.read_text()}")
            continue
        with safe_open(str(f), "pt") as s:
            keys = list(s.keys())
            shapes = {k: (str(s.get_tensor(k).dtype), list(s.get_tensor(k).shape)) for k in keys}
        print(f"  {f.name} ({f.stat().st_size} B): {shapes}")


def same_counts(plain_dir, cooc_dir):
    import safetensors.torch as st

    assert (Path(plain_dir) / "meta_info.json").read_text() == \
        (Path(cooc_dir) / "meta_info.json").read_text(), "meta_info.json differs"
    for rank in range(RANKS):
        a = st.load_file(str(Path(plain_dir) / f"rank{rank}.safetensors"))
        b = st.load_file(str(Path(cooc_dir) / f"rank{rank}.safetensors"))
        assert a.keys() == b.keys(), (rank, a.keys(), b.keys())
        for k in a:
            assert a[k].tolist() == b[k].tolist(), (rank, k)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("expert_statistic_py")
    ap.add_argument("cooccurrence_expert_statistic_py", nargs="?")
    ap.add_argument("--out", default="tests/fixtures/trtllm/expert_statistic")
    ap.add_argument(
        "--expected", default="tests/fixtures/trtllm/expert_statistic.expected.json"
    )
    a = ap.parse_args()

    import safetensors.torch  # noqa: F401  (the files use safetensors.torch via `import safetensors`)

    _stub_tensorrt_llm()
    routes = routing()
    out = Path(a.out)
    if out.exists():
        shutil.rmtree(out)
    with tempfile.TemporaryDirectory() as tmp:
        plain_dir = Path(tmp) / "plain"
        drive(a.expert_statistic_py, plain_dir, routes, "plain")
        print(f"plain writer ({a.expert_statistic_py}):")
        describe(plain_dir)
        if a.cooccurrence_expert_statistic_py:
            drive(a.cooccurrence_expert_statistic_py, out, routes, "cooccurrence")
            print(f"co-occurrence writer ({a.cooccurrence_expert_statistic_py}):")
            describe(out)
            same_counts(plain_dir, out)
            print("the plain writer's meta, keys and counts match the co-occurrence writer's")
        else:
            shutil.copytree(plain_dir, out)
    exp = Path(a.expected)
    exp.write_text(json.dumps(expected(routes), separators=(",", ":")) + "\n")
    print(f"wrote {out}/ and {exp}")


if __name__ == "__main__":
    main()

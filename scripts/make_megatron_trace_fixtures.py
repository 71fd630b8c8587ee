#!/usr/bin/env python3
"""Regenerate tests/fixtures/megatron/: Megatron-Core's routing trace, written by its own code.

    python scripts/make_megatron_trace_fixtures.py MEGATRON_DIR      (from the repository root)

MEGATRON_DIR holds `megatron/core/transformer/moe/router_trace.py` of NVIDIA/Megatron-LM at
commit d98e8a64ddf34856e74b24714e3bedb2f5a39553 (main, 2026-08-22; the file, git blob 043867ad,
is as PR 5220 merged it in c1560d94). It is not in megatron-core 0.16.1 on PyPI; from a clone or
a bare mirror of the repository:

    mkdir DIR && git --git-dir=MIRROR archive d98e8a64 \\
        megatron/core/transformer/moe/router_trace.py | tar -x -C DIR

Needs torch. Only that file is read, loaded as it is (importlib, from the file). It is driven the
way `megatron/training/training.py` drives it under `--moe-routing-trace-path`:
`init_moe_router_tracer(..., rank, training_mode=True)`, then
`get_moe_router_tracer().register_hooks(model)`, which walks the model's `named_modules()` and puts
its forward hook on every `TopKRouter`; the training loop runs the micro-batches and calls
`advance_step(iteration)` at the end of each `train_step`, which writes the step's records. Stubbed,
for what has no CPU meaning or is the input here:

- the rank: each rank is its own process in Megatron (its own module-global tracer), so the
  module is loaded once per rank and given the rank `torch.distributed.get_rank()` would give;
- `torch.cuda.is_current_stream_capturing` (the hook's CUDA-graph check) is False when there is
  no CUDA device (it raises there);
- the two names `register_hooks` imports: `megatron.core.utils.unwrap_model` is the identity (no
  DDP / Float16Module wrapper here), and `megatron.core.transformer.moe.router.TopKRouter` is a
  seeded router: it returns what `TopKRouter.forward` returns in training, `(probs,
  routing_map)`, `routing_map` the bool `[tokens, experts]` map of seeded top-k experts per token.

The model has the module names of a GPTModel: `decoder.layers.{0..4}`, layers 0 and 3 dense (no
router), `.mlp.router` on layers 1, 2 and 4, and one MTP head, `mtp.layers.0.mtp_model_layer.mlp
.router`. Two data-parallel ranks, two training iterations of two micro-batches, 3 tokens a
micro-batch, 16 experts, top-4. The writer turns the routing map into ids by `nonzero()`, so each
token's ids come out in ascending expert order: `expected.json` holds, from the seeded choices
(not from the files), each decoder layer's ids in the order Occult's reader must give them (rank
0's calls in call order, then rank 1's, each token's ids sorted) and the number of MTP records.
`occult-core/src/interop/megatron/router_trace.rs` reads the two files and checks.
"""
import argparse
import hashlib
import importlib.util
import json
import random
import sys
import types
from pathlib import Path

import torch

COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
BLOB = "043867ad98332760ff7dd16692ec0e0431e4dab6"
EXPERTS, TOPK, HIDDEN = 16, 4, 8
NUM_LAYERS, DENSE = 5, {0, 3}
RANKS, ITERATIONS, MICRO_BATCHES, SEQ, MBS = 2, 2, 2, 3, 1

# Every router call, in call order: (rank, block, layer, [[ids of a token], ...]).
CALLS = []


class SeededRouter(torch.nn.Module):
    """Stands in for TopKRouter: seeded top-k choices, returned as TopKRouter.forward returns
    them in training (probs and a bool routing map, both [tokens, experts])."""

    def __init__(self, rng, block, layer):
        super().__init__()
        self.rng, self.block, self.layer = rng, block, layer
        self.topk = TOPK  # the hook reads module.topk to unflatten the routing map
        self.rank = None

    def forward(self, hidden_states, padding_mask=None):
        tokens = hidden_states.shape[0] * hidden_states.shape[1]  # [s, b, h] -> s * b
        chosen = [self.rng.sample(range(EXPERTS), TOPK) for _ in range(tokens)]
        routing_map = torch.zeros(tokens, EXPERTS, dtype=torch.bool)
        probs = torch.zeros(tokens, EXPERTS)
        for t, ids in enumerate(chosen):
            routing_map[t, ids] = True
            probs[t, ids] = torch.softmax(torch.rand(TOPK), 0)
        CALLS.append((self.rank, self.block, self.layer, chosen))
        return probs, routing_map


class Mlp(torch.nn.Module):
    def __init__(self, router=None):
        super().__init__()
        self.router = router

    def forward(self, x):
        if self.router is not None:
            self.router(x)
        return x


class Layer(torch.nn.Module):
    def __init__(self, router=None):
        super().__init__()
        self.mlp = Mlp(router)

    def forward(self, x):
        return self.mlp(x)


class MtpLayer(torch.nn.Module):
    def __init__(self, router):
        super().__init__()
        self.mtp_model_layer = Layer(router)

    def forward(self, x):
        return self.mtp_model_layer(x)


class Block(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Gpt(torch.nn.Module):
    """The module names of a GPTModel with MoE layers and one MTP head."""

    def __init__(self, rng, rank):
        super().__init__()
        layers = [
            Layer(None if i in DENSE else SeededRouter(rng, "decoder", i))
            for i in range(NUM_LAYERS)
        ]
        self.decoder = Block(layers)
        self.mtp = Block([MtpLayer(SeededRouter(rng, "mtp", 0))])
        for m in self.modules():
            if isinstance(m, SeededRouter):
                m.rank = rank

    def forward(self, x):
        return self.mtp(self.decoder(x))


def git_blob(path):
    data = Path(path).read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def load_router_trace(path, rank):
    """A fresh copy of router_trace.py, as one rank's process would import it."""
    core = types.ModuleType("megatron.core")
    utils = types.ModuleType("megatron.core.utils")
    utils.unwrap_model = lambda model: model
    router = types.ModuleType("megatron.core.transformer.moe.router")
    router.TopKRouter = SeededRouter
    for name, mod in [
        ("megatron", types.ModuleType("megatron")),
        ("megatron.core", core),
        ("megatron.core.utils", utils),
        ("megatron.core.transformer", types.ModuleType("megatron.core.transformer")),
        ("megatron.core.transformer.moe", types.ModuleType("megatron.core.transformer.moe")),
        ("megatron.core.transformer.moe.router", router),
    ]:
        sys.modules[name] = mod
    spec = importlib.util.spec_from_file_location(f"megatron_router_trace_rank{rank}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("megatron_dir")
    ap.add_argument("--out", default="tests/fixtures/megatron")
    a = ap.parse_args()
    src = Path(a.megatron_dir) / "megatron/core/transformer/moe/router_trace.py"
    blob = git_blob(src)
    if blob != BLOB:
        print(f"warning: {src} is blob {blob}, not {BLOB} (commit {COMMIT[:8]})", file=sys.stderr)
    if not torch.cuda.is_available():
        torch.cuda.is_current_stream_capturing = lambda: False
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(5220)
    torch.manual_seed(5220)
    for rank in range(RANKS):
        rt = load_router_trace(src, rank)
        model = Gpt(rng, rank)
        # As megatron/training/training.py sets the tracer up before training.
        rt.init_moe_router_tracer(
            output_dir=str(out),
            max_steps=ITERATIONS,
            rank=rank,
            training_mode=True,
        )
        tracer = rt.get_moe_router_tracer()
        tracer.register_hooks(model)
        for iteration in range(ITERATIONS):
            for _ in range(MICRO_BATCHES):
                model(torch.randn(SEQ, MBS, HIDDEN))
            tracer.advance_step(iteration)  # end of train_step
        tracer.flush()  # atexit in Megatron

    layers = {}
    mtp = 0
    for rank in range(RANKS):
        for r, block, layer, chosen in CALLS:
            if r != rank:
                continue
            if block == "mtp":
                mtp += 1
                continue
            layers.setdefault(str(layer), []).extend(i for ids in chosen for i in sorted(ids))
    expected = {
        "source": f"NVIDIA/Megatron-LM {COMMIT}, megatron/core/transformer/moe/router_trace.py "
                  f"(blob {blob}), training-mode forward hooks "
                  "(scripts/make_megatron_trace_fixtures.py)",
        "num_experts": EXPERTS,
        "topk": TOPK,
        "layers": layers,
        "mtp_records": mtp,
    }
    (out / "expected.json").write_text(json.dumps(expected, separators=(",", ":")) + "\n")
    names = ", ".join(f"router_trace_rank{r}.jsonl" for r in range(RANKS))
    print(f"wrote {out}: {names}, expected.json ({len(CALLS)} router calls, {mtp} MTP)")


if __name__ == "__main__":
    main()

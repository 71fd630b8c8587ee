#!/usr/bin/env python3
"""DeepSpeed-MoE's expert parallelism on the CPU, as a peer for `occult bench layer` (issue 48).

Runs `deepspeed.moe.layer.MoE` (DeepSpeed 0.19.8, pinned; its CPU accelerator, torch.distributed
on gloo) on D processes: one MoE layer of E SwiGLU experts, top-k, each rank with its own T
tokens. The router is DeepSpeed's TopKGate: softmax over all experts, the top k, renormalised
over them; with `drop_tokens=False` nothing is dropped (the capacity is the largest expert
count of the step, all-reduced over the ranks, and every all-to-all buffer is padded to it).
Each rank checks its outputs against a plain dense loop in float64 (same weights, same routing
rule), so the peer is known to do the work it is timed on. With `--layer FILE` (written by
`occult bench layer --renormalize --layer-out FILE`) the weights and every rank's tokens are
occult's, and each rank's outputs are also held to occult's output on them.

Reported (JSON on stdout, or --out): the settings and versions; per repeat, the forward time
and (with --train) the forward + backward time, each the slowest rank's, after a barrier; the
all-to-all bytes a rank sends per forward (two all-to-alls, dispatch and combine, each
E x capacity x H x 4 bytes, (D - 1) / D of it to other ranks); each rank's largest difference
from the dense loop.

    python3 scripts/bench_deepspeed_moe.py --install /tmp/dspkgs      # once: pinned, from PyPI
    python3 scripts/bench_deepspeed_moe.py --pkgs /tmp/dspkgs --ranks 4 --tokens 1024 \\
        --hidden 2048 --intermediate 1024 --experts 64 --top-k 8 --train --repeats 3
    occult bench layer --devices 4 --tokens 256 --renormalize --layer-out layer.safetensors
    python3 scripts/bench_deepspeed_moe.py --pkgs /tmp/dspkgs --layer layer.safetensors --train

Needs torch (CPU) in the interpreter, a C++ compiler (DeepSpeed builds its shared-memory
comm op on first use with ninja, installed beside it).
"""
import argparse
import json
import os
import subprocess
import sys
import time

DEEPSPEED = "deepspeed==0.19.8"
# DeepSpeed's own dependencies, without torch (the interpreter's is used).
DEPS = ["hjson==3.1.0", "ninja==1.13.2", "py-cpuinfo==9.0.0", "pydantic==2.14.4",
        "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
        "typing-extensions==4.16.0", "msgpack==1.2.4", "psutil==7.2.2", "einops==0.8.2"]


def install(target):
    env = dict(os.environ, DS_BUILD_OPS="0", DS_ACCELERATOR="cpu")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                    "--target", target, DEEPSPEED, *DEPS], check=True, env=env)


def swiglu_expert(torch, hidden, inter):
    class SwiGLU(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(hidden, inter, bias=False)
            self.up = torch.nn.Linear(hidden, inter, bias=False)
            self.down = torch.nn.Linear(inter, hidden, bias=False)

        def forward(self, x):
            return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))
    return SwiGLU()


def layer_weights(torch, a):
    """Router [E, H] and experts' gate/up [E, I, H], down [E, H, I], from the seed."""
    g = torch.Generator().manual_seed(a.seed)
    h, i, e = a.hidden, a.intermediate, a.experts
    router = torch.randn(e, h, generator=g) * h ** -0.5
    gate = torch.randn(e, i, h, generator=g) * h ** -0.5
    up = torch.randn(e, i, h, generator=g) * h ** -0.5
    down = torch.randn(e, h, i, generator=g) * i ** -0.5
    return router, gate, up, down


def read_layer(a):
    """The layer occult wrote: weights, tokens [D T, H], occult's output; sets the shape."""
    from safetensors import safe_open
    with safe_open(a.layer, "pt") as f:
        md = f.metadata() or {}
        if md.get("format") != "occult.layer.v1":
            sys.exit(f"{a.layer}: not an occult layer file (format {md.get('format')!r})")
        if md.get("renormalize") != "true":
            sys.exit(f"{a.layer}: its router does not renormalise the top-k weights, and "
                     "DeepSpeed's TopKGate does: write it with occult bench layer --renormalize")
        t = {k: f.get_tensor(k) for k in f.keys()}
    a.experts, a.top_k = int(md["experts"]), int(md["top_k"])
    a.ranks, a.tokens = int(md["ranks"]), int(md["tokens_per_rank"])
    a.intermediate, a.hidden = t["gate"].shape[1], t["gate"].shape[2]
    return t


def dense_reference(torch, x, router, gate, up, down, k):
    """The layer as a plain loop in float64: softmax over all experts, top-k, renormalised."""
    x, router, gate, up, down = (t.double() for t in (x, router, gate, up, down))
    probs = torch.softmax(x @ router.T, dim=1)
    top, idx = torch.topk(probs, k, dim=1)
    top = top / top.sum(dim=1, keepdim=True)
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(k):
            ex = int(idx[t, j])
            hid = torch.nn.functional.silu(gate[ex] @ x[t]) * (up[ex] @ x[t])
            y[t] += top[t, j] * (down[ex] @ hid)
    return y


def rank_main(rank, a):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(a.ranks))
    import torch
    import torch.distributed as dist
    import deepspeed
    from deepspeed.moe.layer import MoE
    torch.set_num_threads(a.threads)
    deepspeed.init_distributed(dist_backend="gloo")
    if a.layer:
        t = read_layer(a)
        router, gate, up, down = t["router"], t["gate"], t["up"], t["down"]
    else:
        router, gate, up, down = layer_weights(torch, a)
    moe = MoE(hidden_size=a.hidden, expert=swiglu_expert(torch, a.hidden, a.intermediate),
              num_experts=a.experts, ep_size=a.ranks, k=a.top_k, capacity_factor=1.0,
              eval_capacity_factor=1.0, min_capacity=0, drop_tokens=False, use_residual=False)
    # What deepspeed.initialize would do: the expert-parallel groups, which the gate's
    # all-reduce of the capacity (drop_tokens=False) and the all-to-alls run in.
    moe.set_deepspeed_parallelism()
    local = a.experts // a.ranks
    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight.copy_(router)
        for j, ex in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            g = rank * local + j
            ex.gate.weight.copy_(gate[g])
            ex.up.weight.copy_(up[g])
            ex.down.weight.copy_(down[g])
    if a.layer:
        x = t["tokens"][rank * a.tokens:(rank + 1) * a.tokens].clone()
    else:
        tg = torch.Generator().manual_seed(a.seed + 1 + rank)
        x = torch.randn(a.tokens, a.hidden, generator=tg)
    if not a.train:
        moe.eval()

    def step(train):
        xi = x.clone().requires_grad_(train)
        dist.barrier()
        t0 = time.perf_counter()
        y, _, counts = moe(xi)
        if train:
            y.sum().backward()
        seconds = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return y.detach(), float(seconds), counts

    y, _, counts = step(False)
    want = dense_reference(torch, x, router, gate, up, down, a.top_k)
    diff = torch.tensor([float((y.double() - want).abs().max())])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    ours = torch.tensor([-1.0])
    if a.layer:
        theirs = t["output"][rank * a.tokens:(rank + 1) * a.tokens]
        ours = torch.tensor([float((y - theirs).abs().max())])
        dist.all_reduce(ours, op=dist.ReduceOp.MAX)
    # drop_tokens=False: the capacity is the largest expert count over every rank.
    cap = counts.max().clone()
    dist.all_reduce(cap, op=dist.ReduceOp.MAX)
    forward, train = [], []
    for _ in range(a.repeats):
        forward.append(step(False)[1])
        if a.train:
            train.append(step(True)[1])
    per_all_to_all = a.experts * int(cap) * a.hidden * 4
    if rank == 0:
        report = {
            "peer": "deepspeed-moe", "deepspeed": deepspeed.__version__,
            "torch": torch.__version__, "backend": "gloo",
            "settings": {k: getattr(a, k) for k in ("ranks", "tokens", "hidden",
                         "intermediate", "experts", "top_k", "repeats", "seed", "threads")},
            "router": "softmax over all experts, top-k renormalised (TopKGate)",
            "drop_tokens": False, "capacity": int(cap),
            "forward_seconds": forward, "train_seconds": train,
            "all_to_all_bytes_per_forward": 2 * per_all_to_all,
            "remote_bytes_per_forward": 2 * per_all_to_all * (a.ranks - 1) // a.ranks,
            "max_abs_diff_from_dense": float(diff),
            "layer": a.layer,
            "max_abs_diff_from_occult": float(ours) if a.layer else None,
        }
        text = json.dumps(report, indent=1)
        if a.out:
            with open(a.out, "w") as f:
                f.write(text + "\n")
        print(text, flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--install", metavar="DIR", help="pip-install the pinned DeepSpeed into DIR")
    p.add_argument("--pkgs", metavar="DIR", help="where --install put it")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=32)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", action="store_true", help="also time forward + backward")
    p.add_argument("--port", type=int, default=29571)
    p.add_argument("--layer", help="occult's layer file (occult bench layer --layer-out)")
    p.add_argument("--out")
    a = p.parse_args()
    if a.install:
        install(a.install)
        return
    if a.layer:
        read_layer(a)
    if a.experts % a.ranks:
        sys.exit(f"--experts {a.experts} is not a multiple of --ranks {a.ranks}")
    if a.pkgs:
        sys.path.insert(0, a.pkgs)
        os.environ["PYTHONPATH"] = a.pkgs + os.pathsep + os.environ.get("PYTHONPATH", "")
        os.environ["PATH"] = os.path.join(a.pkgs, "bin") + os.pathsep + os.environ["PATH"]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    import torch.multiprocessing as mp
    mp.spawn(rank_main, args=(a,), nprocs=a.ranks, join=True)


if __name__ == "__main__":
    main()

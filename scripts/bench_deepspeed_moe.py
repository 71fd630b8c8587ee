#!/usr/bin/env python3
"""DeepSpeed-MoE's expert parallelism on the CPU, as a peer for `occult bench layer` (issue 48).

Runs `deepspeed.moe.layer.MoE` (DeepSpeed 0.19.8, pinned; its CPU accelerator, torch.distributed
on gloo) on D processes: one MoE layer of E SwiGLU experts, top-k, each rank with its own T
tokens. The router is DeepSpeed's TopKGate: softmax over all experts, the top k, renormalised
over them; with `drop_tokens=False` nothing is dropped (the capacity is the largest expert
count of the step, all-reduced over the ranks, and every all-to-all buffer is padded to it).
Each rank checks its outputs against a plain dense loop in float64 (same weights, same routing
rule), so the peer is known to do the work it is timed on. With `--layer FILE` (written by
`occult bench layer --renormalize --layer-out FILE`) the weights, every rank's tokens and the
placement are occult's (DeepSpeed's expert slots are filled so that each rank holds the experts
occult's placement gives it), and each rank's outputs are also held to occult's output on them.
Under mpirun (`scripts/shaped_links.sh -e`) each process is one rank.

`--compare` (as root) runs both engines over the same shaped links: per repeat, occult's
`bench layer` forward, this script's DeepSpeed run (forward and training steps), then occult's
`bench layer --train`, each under `scripts/shaped_links.sh` (a fresh set of namespaces with the
same links each run), all on the one layer file; then one table with each engine's median times,
the rows and bytes each sends to other ranks (DeepSpeed's padded to its capacity, and its
unpadded pairs, which equal occult's standard dispatch's remote rows when placement and routing
are the same), and the median over repeats of DeepSpeed's time over each occult mode's.

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
    sudo python3 scripts/bench_deepspeed_moe.py --pkgs /tmp/dspkgs --compare --ranks 4 \
        --rate 80mbit [--per-node 2] --repeats 3      # both, over the same shaped links

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


def expert_order(a, t):
    """The global expert each DeepSpeed slot holds: DeepSpeed puts slots r E/D .. (r+1) E/D on
    rank r, so listing the layer file's experts by the rank its placement gives them (E / D
    each) puts every expert on the rank occult puts it on. Identity without a placement."""
    if t is None or "device_of_expert" not in t:
        return list(range(a.experts))
    dev = [int(d) for d in t["device_of_expert"]]
    per = a.experts // a.ranks
    counts = [dev.count(r) for r in range(a.ranks)]
    if len(dev) != a.experts or counts != [per] * a.ranks:
        sys.exit(f"{a.layer}: device_of_expert does not put {per} experts on each of the "
                 f"{a.ranks} ranks (counts {counts}); DeepSpeed's experts are E / D a rank")
    return sorted(range(a.experts), key=lambda e: (dev[e], e))


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
    t = None
    if a.layer:
        t = read_layer(a)
        router, gate, up, down = t["router"], t["gate"], t["up"], t["down"]
    else:
        router, gate, up, down = layer_weights(torch, a)
    order = expert_order(a, t)
    moe = MoE(hidden_size=a.hidden, expert=swiglu_expert(torch, a.hidden, a.intermediate),
              num_experts=a.experts, ep_size=a.ranks, k=a.top_k, capacity_factor=1.0,
              eval_capacity_factor=1.0, min_capacity=0, drop_tokens=False, use_residual=False)
    # What deepspeed.initialize would do: the expert-parallel groups, which the gate's
    # all-reduce of the capacity (drop_tokens=False) and the all-to-alls run in.
    moe.set_deepspeed_parallelism()
    local = a.experts // a.ranks
    with torch.no_grad():
        # Slot s routes with expert order[s]'s router row and runs its weights.
        moe.deepspeed_moe.gate.wg.weight.copy_(router[order])
        for j, ex in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            g = order[rank * local + j]
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
    # The (token, expert) pairs whose expert is on another rank: the rows a dispatch without
    # padding sends (occult's standard dispatch), against which the padding is counted.
    probs = torch.softmax(x.double() @ router.double().T, dim=1)
    _, idx = torch.topk(probs, a.top_k, dim=1)
    slot_of = {e: s for s, e in enumerate(order)}
    remote = torch.tensor([sum(1 for e in idx.flatten().tolist()
                               if slot_of[e] // local != rank)])
    dist.all_reduce(remote)
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
            "placement": "the layer file's" if t is not None and "device_of_expert" in t
                         else "contiguous",
            "forward_seconds": forward, "train_seconds": train,
            "all_to_all_bytes_per_forward": 2 * per_all_to_all,
            # Every rank's bytes to other ranks, summed over the ranks (as occult counts
            # them): dispatch and combine, each E x capacity rows of H f32 a rank, (D-1)/D
            # of them remote; a training step runs both again backwards.
            "remote_rows_dispatched": a.experts * int(cap) * (a.ranks - 1),
            "remote_bytes_per_forward": 2 * per_all_to_all * (a.ranks - 1),
            "remote_bytes_per_train_step": 4 * per_all_to_all * (a.ranks - 1),
            "remote_pairs": int(remote),
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


def occult_flags(a):
    """`occult bench layer`'s flags for the layer that --compare runs (without --devices,
    which scripts/shaped_links.sh adds)."""
    f = ["bench", "layer", "--experts", a.experts, "--top-k", a.top_k, "--hidden", a.hidden,
         "--intermediate", a.intermediate, "--tokens", a.tokens, "--seed", a.seed,
         "--clusters", a.clusters, "--renormalize", "--max-devices", "0"]
    if a.per_node:
        f += ["--devices-per-node", a.per_node]
    return [str(x) for x in f]


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def compare(a):
    """occult's bench layer and DeepSpeed-MoE alternately over the same shaped links, on the
    same layer and tokens (occult writes the layer file, DeepSpeed runs it with occult's
    placement); one table of paired ratios."""
    import tempfile
    if os.geteuid() != 0:
        sys.exit("--compare needs root: scripts/shaped_links.sh makes network namespaces")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shaped = os.path.join(root, "scripts", "shaped_links.sh")
    occult = os.path.abspath(a.occult)
    if not os.access(occult, os.X_OK):
        sys.exit(f"{occult} is missing: cargo build --release --features occult-eval/mpi "
                 "(or give --occult)")
    work = a.work or tempfile.mkdtemp(prefix="occult-vs-deepspeed-")
    os.makedirs(work, exist_ok=True)
    layer = os.path.join(work, "layer.safetensors")
    flags = occult_flags(a)
    subprocess.run([occult, *flags, "--devices", str(a.ranks), "--steps", "1", "--warmup", "0",
                    "--layer-out", layer], check=True, stdout=subprocess.DEVNULL)
    links = [shaped, "-n", str(a.ranks), "-r", a.rate]
    if a.per_node:
        links += ["-g", str(a.per_node), "-i", a.intra]
    env = dict(os.environ, OCCULT_BIN=occult, RAYON_NUM_THREADS=str(a.threads))
    me = [sys.executable, os.path.abspath(__file__), "--layer", layer, "--train",
          "--repeats", str(a.steps), "--threads", str(a.threads)]
    if a.pkgs:
        me += ["--pkgs", os.path.abspath(a.pkgs)]
    runs = []
    for r in range(a.repeats):
        run = {}
        for what in ("forward", "deepspeed", "train"):
            out = os.path.join(work, f"{what}-{r}.json")
            if what == "deepspeed":
                cmd = links + ["-e", "--"] + me + ["--out", out]
            else:
                cmd = links + ["--"] + flags + ["--steps", str(a.steps), "--json", out]
                cmd += ["--train"] if what == "train" else []
            print(f"repeat {r + 1}/{a.repeats}: {what}", file=sys.stderr, flush=True)
            done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL)
            if done.returncode != 0:
                sys.exit(f"repeat {r + 1}, {what}: exited with {done.returncode} "
                         f"(its messages are above; files so far in {work})")
            with open(out) as f:
                run[what] = json.load(f)
        runs.append(run)
    report = summarise(a, runs)
    text = json.dumps(report, indent=1)
    with open(os.path.join(work, "compare.json"), "w") as f:
        f.write(text + "\n")
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print_table(report)
    print(f"files: {work}", file=sys.stderr)


def summarise(a, runs):
    """Per mode: median times, bytes, and the median over repeats of DeepSpeed's time over
    the mode's (paired: each repeat's runs share one setup of the links)."""
    ds = [r["deepspeed"] for r in runs]
    ds_fwd = [median(d["forward_seconds"]) for d in ds]
    ds_train = [median(d["train_seconds"]) for d in ds]
    modes = []
    for name in ("standard", "occult", "two-level"):
        fwd = [next((m for m in r["forward"]["results"] if m["mode"] == name), None)
               for r in runs]
        train = [next((m for m in r["train"]["results"] if m["mode"] == name), None)
                 for r in runs]
        if fwd[0] is None:
            continue
        modes.append({
            "engine": "occult", "mode": name,
            "forward_seconds": [m["seconds"] for m in fwd],
            "train_seconds": [m["seconds"] for m in train],
            "remote_rows_dispatched": fwd[0]["remote_rows_sent"],
            "inter_node_rows_dispatched": fwd[0]["inter_node_rows"] if a.per_node else None,
            "remote_bytes_per_forward": fwd[0]["bytes_sent"],
            "remote_bytes_per_train_step": train[0]["bytes_sent"],
            "deepspeed_over_this_forward": median(
                [d / m["seconds"] for d, m in zip(ds_fwd, fwd)]),
            "deepspeed_over_this_train": median(
                [d / m["seconds"] for d, m in zip(ds_train, train)]),
        })
    d0 = ds[0]
    g = a.per_node or a.ranks
    per = d0["all_to_all_bytes_per_forward"] // 2
    peer = {
        "engine": "deepspeed-moe", "mode": "TopKGate, drop_tokens=False",
        "deepspeed": d0["deepspeed"], "torch": d0["torch"], "capacity": d0["capacity"],
        "forward_seconds": ds_fwd, "train_seconds": ds_train,
        "remote_rows_dispatched": d0["remote_rows_dispatched"],
        "remote_pairs": d0["remote_pairs"],
        # Rank r sends each other rank E/D x capacity rows; those of other nodes cross them.
        "inter_node_rows_dispatched": (d0["remote_rows_dispatched"] // (a.ranks - 1)
                                       * (a.ranks - g) if a.per_node else None),
        "remote_bytes_per_forward": d0["remote_bytes_per_forward"],
        "remote_bytes_per_train_step": d0["remote_bytes_per_train_step"],
        "max_abs_diff_from_occult": max(d["max_abs_diff_from_occult"] for d in ds),
        "all_to_all_bytes_per_rank": per,
    }
    return {"settings": {k: getattr(a, k) for k in (
                "ranks", "per_node", "rate", "intra", "tokens", "hidden", "intermediate",
                "experts", "top_k", "clusters", "repeats", "steps", "threads", "seed")},
            "modes": modes, "deepspeed": peer}


def print_table(rep):
    s = rep["settings"]
    where = (f"{s['ranks']} ranks in nodes of {s['per_node']} ({s['intra']} inside, "
             f"{s['rate']} between)" if s["per_node"] else f"{s['ranks']} ranks over {s['rate']}")
    router = f"{s['clusters']} clusters" if s["clusters"] else "unstructured"
    print(f"one MoE layer, {s['experts']} experts, top-{s['top_k']}, hidden {s['hidden']}, "
          f"intermediate {s['intermediate']}, router {router}, {s['tokens']} tokens a rank; {where}; "
          f"median of {s['repeats']} paired repeats")
    print("| engine, mode | forward ms | train step ms | remote rows (across nodes) | "
          "remote MB fwd | remote MB train | DeepSpeed / this, fwd | DeepSpeed / this, train |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    p = rep["deepspeed"]

    def across(m):
        n = m["inter_node_rows_dispatched"]
        return f" ({n:,})" if n is not None else ""
    print(f"| DeepSpeed-MoE {p['deepspeed']} | {median(p['forward_seconds']) * 1e3:.1f} | "
          f"{median(p['train_seconds']) * 1e3:.1f} | {p['remote_rows_dispatched']:,}{across(p)} "
          f"(capacity {p['capacity']}; {p['remote_pairs']:,} unpadded) | "
          f"{p['remote_bytes_per_forward'] / 1e6:.2f} | "
          f"{p['remote_bytes_per_train_step'] / 1e6:.2f} | 1 | 1 |")
    for m in rep["modes"]:
        print(f"| occult {m['mode']} | {median(m['forward_seconds']) * 1e3:.1f} | "
              f"{median(m['train_seconds']) * 1e3:.1f} | {m['remote_rows_dispatched']:,}{across(m)} | "
              f"{m['remote_bytes_per_forward'] / 1e6:.2f} | "
              f"{m['remote_bytes_per_train_step'] / 1e6:.2f} | "
              f"{m['deepspeed_over_this_forward']:.2f}x | {m['deepspeed_over_this_train']:.2f}x |")
    std = next((m for m in rep["modes"] if m["mode"] == "standard"), None)
    if std:
        # The baseline per byte: each one's time over the remote bytes it sent.
        per_byte = [median(p["forward_seconds"]) / p["remote_bytes_per_forward"],
                    median(std["forward_seconds"]) / std["remote_bytes_per_forward"]]
        print(f"\noccult standard / DeepSpeed: forward time {1 / std['deepspeed_over_this_forward']:.2f}, "
              f"train time {1 / std['deepspeed_over_this_train']:.2f}, forward time per remote "
              f"byte {per_byte[1] / per_byte[0]:.2f}")
        same = p["remote_pairs"] == std["remote_rows_dispatched"]
        print(f"same placement and routing: DeepSpeed's unpadded remote pairs "
              f"{p['remote_pairs']:,} {'==' if same else '!='} occult standard's remote rows "
              f"{std['remote_rows_dispatched']:,}")
    print(f"DeepSpeed's output against occult's: at most {p['max_abs_diff_from_occult']:.1e}")


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
    p.add_argument("--compare", action="store_true",
                   help="run occult's bench layer and this peer alternately over shaped links "
                        "(scripts/shaped_links.sh, as root) and print one table")
    p.add_argument("--rate", default="80mbit", help="--compare: the links' rate (between nodes)")
    p.add_argument("--per-node", type=int, default=0,
                   help="--compare: ranks per node (0: one flat group of links)")
    p.add_argument("--intra", default="10gbit", help="--compare: the links inside a node")
    p.add_argument("--steps", type=int, default=3,
                   help="--compare: measured steps in each run (the repeats are runs)")
    p.add_argument("--occult", default="target/release/occult",
                   help="--compare: occult built with MPI (--features occult-eval/mpi)")
    p.add_argument("--clusters", type=int, default=8,
                   help="--compare: the bench router's latent clusters (0: unstructured)")
    p.add_argument("--table", metavar="JSON", help="print the table of a --compare report again")
    p.add_argument("--work", help="--compare: where the runs' files go (a new folder by default)")
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
    if a.table:
        with open(a.table) as f:
            print_table(json.load(f))
        return
    if a.compare:
        if a.per_node and (a.per_node >= a.ranks or a.ranks % a.per_node):
            sys.exit(f"--per-node {a.per_node} must divide --ranks {a.ranks} into 2 or more nodes")
        compare(a)
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(MASTER_ADDR=os.environ.get("SHAPED_MASTER_ADDR", "127.0.0.1"),
                      MASTER_PORT=str(a.port))
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        # Launched by mpirun (scripts/shaped_links.sh -e): one rank a process, over the
        # shaped interface.
        size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
        if size != a.ranks:
            sys.exit(f"mpirun started {size} processes, and the layer has {a.ranks} ranks")
        if "SHAPED_IFNAME" in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = os.environ["SHAPED_IFNAME"]
        rank_main(int(os.environ["OMPI_COMM_WORLD_RANK"]), a)
        return
    import torch.multiprocessing as mp
    mp.spawn(rank_main, args=(a,), nprocs=a.ranks, join=True)


if __name__ == "__main__":
    main()

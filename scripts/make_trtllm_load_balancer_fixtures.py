#!/usr/bin/env python3
"""Regenerate tests/fixtures/trtllm/load_balancer.json: TensorRT-LLM's load-balancer YAML as
its generator writes it and as its engine parses it.

    python scripts/make_trtllm_load_balancer_fixtures.py      (from the repository root)

Needs PyYAML only. Each case is a seeded assignment (the model's MoE layer indices, each a list
of `num_slots` logical experts, rank-major, with or without replicas; without, each rank's
experts ascending, the order Occult lists a partition in). The text is what
`examples/wide_ep/ep_load_balancer/generate_eplb_config.py` (NVIDIA/TensorRT-LLM at
76a646e90c8e863629009ea5d365697da147348f) writes: `yaml.dump` of the dict with keys
num_slots, initial_global_assignments and layer_updates_per_iter, lists in flow style, no
line width. `yaml.safe_load` of it, as `TorchLlmArgs.validate_load_balancer` reads the file,
must give back int layer keys and the same lists. The Rust writer
(`occult-core/src/interop/trtllm/load_balancer.rs`) must write the same bytes and read back the
same rows.
"""
import json
import random
from pathlib import Path

import yaml


class FlowLists(yaml.Dumper):
    """A dumper that writes every list on one line, as the generator's representer does."""


FlowLists.add_representer(
    list, lambda d, data: d.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)
)


def case(rng, experts, ranks, replicas, layers):
    slots = experts + replicas
    per = slots // ranks
    rows = {}
    for layer in layers:
        while True:
            order = list(range(experts)) + rng.sample(range(experts), replicas)
            rng.shuffle(order)
            if all(len(set(order[r * per:(r + 1) * per])) == per for r in range(ranks)):
                break
        if replicas == 0:
            # A partition has no slot order within a rank: Occult lists each rank's ascending.
            order = [x for r in range(ranks) for x in sorted(order[r * per:(r + 1) * per])]
        rows[layer] = order
    config = {
        "num_slots": slots,
        "initial_global_assignments": rows,
        "layer_updates_per_iter": 0,
    }
    text = yaml.dump(config, Dumper=FlowLists, width=float("inf"))
    back = yaml.safe_load(text)
    assert back["initial_global_assignments"] == rows
    assert all(isinstance(k, int) for k in back["initial_global_assignments"])
    return {
        "experts": experts,
        "ep_size": ranks,
        "layers": [[l, r] for l, r in rows.items()],
        "yaml": text,
    }


def main():
    rng = random.Random(46)
    cases = [
        case(rng, 8, 2, 0, [0, 1]),
        case(rng, 8, 4, 4, [1, 2, 3]),
        case(rng, 64, 8, 0, [3, 4, 5]),
        case(rng, 64, 8, 8, list(range(3, 13))),
        case(rng, 16, 4, 16, [0]),
    ]
    out = Path("tests/fixtures/trtllm/load_balancer.json")
    out.write_text(json.dumps({"pyyaml": yaml.__version__, "cases": cases}, indent=1) + "\n")
    print(f"wrote {out}: {len(cases)} cases (PyYAML {yaml.__version__})")


if __name__ == "__main__":
    main()

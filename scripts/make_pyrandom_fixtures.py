#!/usr/bin/env python3
"""Writes tests/fixtures/pyrandom.json: what CPython's random.Random produced for a fixed script
of calls, per seed. occult-eval's `harness::pyrandom` is held to it (lm-evaluation-harness draws
few-shot examples with random.Random(seed).sample). Run: python3 scripts/make_pyrandom_fixtures.py
"""
import json
import random
import sys
from pathlib import Path

SEEDS = [0, 1, 42, 1234, 2**32 + 5, 2**64 - 1]
SAMPLES = [(5, 3), (10, 10), (21, 6), (30, 6), (100, 7), (1000, 25), (26, 25), (3, 0), (400, 26)]
BELOW = [1, 2, 3, 10, 100, 1000, 2**31 + 1, 2**32, 2**40 + 3]


def run(seed):
    r = random.Random(seed)
    ops = []
    ops.append({"op": "getrandbits", "k": 32, "out": [r.getrandbits(32) for _ in range(8)]})
    ops.append({"op": "getrandbits", "k": 5, "out": [r.getrandbits(5) for _ in range(4)]})
    ops.append({"op": "getrandbits", "k": 64, "out": [r.getrandbits(64) for _ in range(3)]})
    for n in BELOW:
        ops.append({"op": "randbelow", "n": n, "out": [r._randbelow(n) for _ in range(5)]})
    for n, k in SAMPLES:
        ops.append({"op": "sample", "n": n, "k": k, "out": r.sample(range(n), k)})
    x = list(range(12))
    r.shuffle(x)
    ops.append({"op": "shuffle", "n": 12, "out": x})
    return {"seed": str(seed), "ops": ops}


def main():
    out = {
        "python": sys.version.split()[0],
        "streams": [run(s) for s in SEEDS],
    }
    path = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "pyrandom.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

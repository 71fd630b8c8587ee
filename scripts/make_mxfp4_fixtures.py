#!/usr/bin/env python3
"""Regenerate tests/fixtures/mxfp4/: gpt-oss's MXFP4 expert weights dequantized by transformers.

    /work/venv/bin/python scripts/make_mxfp4_fixtures.py      (from the repository root)

Needs torch, safetensors and transformers (5.25.0 was used). gpt-oss checkpoints store each
expert projection as `*_blocks` (uint8 `[experts, rows, groups, 16]`: two 4-bit E2M1 codes a
byte, the low nibble first) and `*_scales` (uint8 `[experts, rows, groups]`: an E8M0 exponent,
biased by 127, per group of 32 values). transformers dequantizes them on load with
`transformers.integrations.mxfp4.convert_moe_packed_tensors`, called here as it is, into
`[experts, groups * 32, rows]` (the layout gpt-oss's experts multiply by).

Writes `cases.safetensors`: for each case `c`, `c.blocks` and `c.scales` (the packed input) and
`c.bf16` and `c.f32` (transformers' output in each dtype). Cases: seeded random codes with
exponents around the bias, every code against every exponent of the E8M0 range (0 to 255,
where 2^(e - 127) leaves f32's normal range at both ends: subnormals, and inf and NaN past
2^127), and a gate_up_proj-shaped case of gpt-oss's layout scaled down.
"""
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "mxfp4"


def case(name, blocks, scales, out):
    out[f"{name}.blocks"] = blocks.contiguous()
    out[f"{name}.scales"] = scales.contiguous()
    for dtype, key in [(torch.bfloat16, "bf16"), (torch.float32, "f32")]:
        got = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
        out[f"{name}.{key}"] = got.contiguous()


def main():
    g = torch.Generator().manual_seed(0)
    out = {}
    # Random codes, exponents near the bias (the values real weights take).
    blocks = torch.randint(0, 256, (2, 6, 3, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 132, (2, 6, 3), generator=g, dtype=torch.uint8)
    case("random", blocks, scales, out)
    # Every code (both nibbles) under every exponent: 256 rows of one group.
    codes = torch.arange(16, dtype=torch.uint8)
    row = (codes | (codes.flip(0) << 4)).repeat(1)  # 16 bytes: lo = c, hi = 15 - c
    blocks = row.expand(1, 256, 1, 16).clone()
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(1, 256, 1)
    case("every_exponent", blocks, scales, out)
    # gpt-oss's gate_up_proj scaled down: hidden 64 (2 groups), 2 * intermediate 8 rows, 4 experts.
    blocks = torch.randint(0, 256, (4, 8, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 130, (4, 8, 2), generator=g, dtype=torch.uint8)
    case("gate_up", blocks, scales, out)
    OUT.mkdir(parents=True, exist_ok=True)
    save_file(out, OUT / "cases.safetensors")
    print(f"wrote {OUT / 'cases.safetensors'} ({len(out)} tensors)")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Regenerate tests/fixtures/export/: references for `occult export checkpoint`, made by transformers.

    /work/venv/bin/python scripts/make_export_fixtures.py      (from the repository root)

Needs torch, transformers (v5), safetensors; reuses scripts/make_model_fixtures.py. Float32 on the
CPU, seeded: a rerun rewrites the same files.

1. Tiny checkpoints of the families transformers runs and make_model_fixtures.py does not write,
   each in `tests/fixtures/models/<family>/` with config.json, the shared tokenizer.json and
   reference.json (as make_model_fixtures.py writes it: `mm.reference`, seed picked so that no
   routing choice nor argmax is closer than mm.MARGIN), each folder reloaded with `from_pretrained`
   (no missing or unexpected tensors, the reference model's logits):
   - `deepseek_v3/` (`DeepseekV3ForCausalLM`: MLA attention, sigmoid router with
     `e_score_correction_bias`, 4 expert groups of which each token keeps 2, a shared expert,
     layer 0 dense), `deepseek_v2/` and `glm4_moe/`, per expert in the hub's names;
   - `gpt_oss/` (`GptOssForCausalLM`, seed 4000): attention sinks, a sliding (window 4, shorter
     than the 21-token prompt) and a full layer, the router `mlp.router` with a bias, fused experts
     `mlp.experts.gate_up_proj` [E, H, 2I] (gate and up columns interleaved) with biases, hidden
     32. Every parameter is normal(0, 0.1) (transformers' own init zeroes the expert biases) and
     swiglu_limit is 1.0 rather than gpt-oss's 7.0 (never reached here), so that on the prompt
     both clamps of the clamped SwiGLU bite in both layers (gate > limit: 23 and 23 of 672 values;
     up > limit: 22 and 33; up < -limit: 34 and 30). check_gpt_oss asserts it, and that zeroing
     the sinks, the router bias or either expert bias, or lifting the limit, moves the logits
     (by 0.75, 0.69, 0.52, 0.90, 0.47). gpt-oss's router takes the top k of its biased logits and
     softmaxes only those, so its routing margin is the k-th against the (k+1)-th logit
     (3.6e-4; 5.6e-5 between full-softmax probabilities, which gpt-oss never computes);
   - `gpt_oss_mxfp4/` (seed 6000): the same model at hidden 64, intermediate 32, its experts as
     gpt-oss's published checkpoints store them: `mlp.experts.gate_up_proj_blocks` uint8
     [E, 2I, H/32, 16] and `..._scales` uint8 [E, 2I, H/32], `down_proj_blocks` [E, H, I/32, 16]
     and `down_proj_scales` [E, H, I/32] (random codes, E8M0 exponents 121 to 123), the biases
     float32, and config.json's published `quantization_config`. The reference model holds
     transformers' own dequantization of those bytes (`convert_moe_packed_tensors(blocks, scales,
     dtype=float32)`, which returns the parameters' [E, H, 2I] and [E, I, H]). Routing margin
     9.0e-4 (logits), argmax 6.7e-3; clamps per layer 174 / 181 gate, 170 / 166 up above and
     174 / 206 up below, of 1344. transformers loads the folder on this CPU with
     `from_pretrained(folder, quantization_config=Mxfp4Config(dequantize=True))`, with the
     reference model's logits exactly (asserted within 1e-5); a plain `from_pretrained(folder)`
     (transformers 5.25.0, triton 3.9.0 and kernels 0.19.1 installed, accelerate not) stops in
     Mxfp4HfQuantizer.validate_environment with
     "ImportError: Using mxfp4 requires Accelerate: `pip install accelerate`".
   Occult runs deepseek_v2, deepseek_v3, glm4_moe and gpt_oss against their reference.json;
   gpt_oss_mxfp4 is the same test for gpt-oss's MXFP4 checkpoints.
2. `tests/fixtures/export/cases.json`: for every family fixture but gpt_oss_mxfp4, in the
   per-expert and the fused layout, and seeded random balanced placements on 2, 4 and 8 devices
   (whole expert groups for V3), this script renumbers the checkpoint with its own code (device
   0's experts first, each device's in ascending id: per-expert tensors renamed; fused expert
   tensors, router rows and selection biases permuted), loads the result with transformers
   (`from_pretrained`; DeepSeek-MoE v1 with the fixture script's own model) and asserts its logits
   equal the original's (1e-5). It records the placement and a SHA-256 over the renumbered tensors
   (each name, a NUL, its bytes, in name order). The Rust test exports the same placement and
   checks the same digest: so Occult's export is, byte for byte, a checkpoint transformers was seen
   to run with the original's logits.
"""
import copy
import hashlib
import json
import random
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_model_fixtures as mm  # noqa: E402
from transformers import (  # noqa: E402
    DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM, GptOssConfig,
    GptOssForCausalLM, Mxfp4Config)
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "fixtures" / "models"
OUT = ROOT / "tests" / "fixtures" / "export"
DEVICES = (2, 4, 8)
V2 = "deepseek_v2"
V3 = "deepseek_v3"
GLM = "glm4_moe"
GPT_OSS = "gpt_oss"
GPT_OSS_MXFP4 = "gpt_oss_mxfp4"


# ---------------------------------------------------------------- the DeepSeek-V3 fixture
def v3_config(vocab, eot):
    """Latent attention with every optional part on: low-rank queries, biases, a value width
    (12) other than the query/key width (16), and YaRN with a softmax scale (mscale_all_dim) and
    an attention factor (mscale / mscale_all_dim) other than 1."""
    return DeepseekV3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, moe_intermediate_size=8,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=8, q_lora_rank=16,
        qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True, attention_bias=True,
        max_position_embeddings=128, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 0.8, "original_max_position_embeddings": 32},
        bos_token_id=eot, eos_token_id=eot, pad_token_id=None)


def make_v3(tok_vocab, eot):
    """A tiny DeepSeek-V3 with its reference outputs (reference.json): Occult runs it."""
    make_with_reference(V3, DeepseekV3ForCausalLM, v3_config(tok_vocab, eot), seeds=range(2000, 2100))


# ---------------------------------------------------------------- the DeepSeek-V2 fixture
def v2_config(vocab, eot):
    """V2-Lite's shape: direct queries, the softmax router keeping 2 of 4 groups by their best
    expert (group_limited_greedy), no renormalisation, scaled, 2 shared experts, YaRN with V2's
    mscale of 0.707 on both sides (its softmax scale moves, its cos/sin do not)."""
    return DeepseekV2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, moe_intermediate_size=8,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=2,
        n_routed_experts=8, routed_scaling_factor=1.5, kv_lora_rank=8, q_lora_rank=None,
        qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
        norm_topk_prob=False, max_position_embeddings=128, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 32},
        bos_token_id=eot, eos_token_id=eot, pad_token_id=None)


def make_v2(tok_vocab, eot):
    """A tiny DeepSeek-V2 with its reference outputs: Occult runs it."""
    make_with_reference(V2, DeepseekV2ForCausalLM, v2_config(tok_vocab, eot), seeds=range(5000, 5100))


# ---------------------------------------------------------------- the GLM-4.5 fixture
def glm_config(vocab, eot):
    return Glm4MoeConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, moe_intermediate_size=8,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.5, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
        max_position_embeddings=128, tie_word_embeddings=False,
        bos_token_id=eot, eos_token_id=eot, pad_token_id=None)


def make_glm(tok_vocab, eot):
    """A tiny GLM-4.5 (`Glm4MoeForCausalLM`: partial rotary, q/k norms, q/k/v biases, the
    sigmoid router with its selection bias and 4 expert groups keeping 2, a shared expert, layer
    0 dense), per expert in the hub's names, with reference outputs (reference.json, as
    scripts/make_model_fixtures.py writes them): Occult runs it."""
    make_with_reference(GLM, Glm4MoeForCausalLM, glm_config(tok_vocab, eot), seeds=range(3000, 3100))


def make_with_reference(arch, cls, config, seeds, build=None, load=None):
    """The first seed whose routing and argmaxes clear mm.MARGIN on every reference input (as
    make_model_fixtures.py picks them), written with its reference.json. `build(seed)` gives the
    reference model and the checkpoint to write (default: build_with_buffers, and the model's
    tensors in the hub's names); `load` adds from_pretrained arguments for the reload check.
    Returns the model and its seed."""
    tok = mm.Tokenizer.from_file(str(MODELS / "tokenizer.json"))
    eot_id = tok.token_to_id(mm.EOT)
    build = build or (lambda s: plain(arch, cls, config, s))
    for seed in seeds:
        model, hub = build(seed)
        ref, route_gap, argmax_gap = mm.reference(model, tok, eot_id, config.num_experts_per_tok, seed)
        new = ref["greedy"]["ids"]
        varied = max(new) < tok.get_vocab_size() and eot_id not in new and len(set(new)) >= 3
        if route_gap >= mm.MARGIN and argmax_gap >= mm.MARGIN and varied and ref["loglik"][-1]["is_greedy"]:
            break
        print(f"  {arch}: seed {seed} rejected (routing gap {route_gap:.2e}, argmax gap {argmax_gap:.2e})")
    else:
        raise SystemExit(f"{arch}: no seed in range gives clear routing")
    write_fixture(arch, cls, config, model, hub, load or {})
    mm.dump_reference(MODELS / arch / "reference.json", ref)
    print(f"{arch}: seed {seed}, routing gap {route_gap:.2e}, argmax gap {argmax_gap:.2e}, greedy {new}")
    return model, seed


def build_with_buffers(arch, cls, config, seed):
    """mm.build, and the selection bias (a buffer, not a parameter) given values too."""
    model = mm.build(arch, cls, config, seed=seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model


def plain(arch, cls, config, seed):
    """build_with_buffers, and its tensors as the fixture stores them: gpt-oss's as the model
    holds them (fused, [E, H, 2I]), the others' per expert in the hub's names."""
    model = build_with_buffers(arch, cls, config, seed)
    sd = model.state_dict()
    return model, ({k: v.contiguous() for k, v in sd.items()} if arch == GPT_OSS else mm.to_hub(arch, sd))


# ---------------------------------------------------------------- the gpt-oss fixtures
SWIGLU_LIMIT = 1.0  # gpt-oss's is 7.0, which these tiny models' gate and up values never reach
MXFP4_SCALES = (121, 124)  # E8M0 exponents drawn in [121, 124): 2^-6 to 2^-4, weights of std ~0.12
MXFP4_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def gpt_oss_config(vocab, eot, hidden=32, intermediate=16):
    return GptOssConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=8,
        num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
        sliding_window=4, max_position_embeddings=128, tie_word_embeddings=False,
        swiglu_limit=SWIGLU_LIMIT, bos_token_id=eot, eos_token_id=eot, pad_token_id=None)


def make_gpt_oss(tok_vocab, eot):
    """A tiny gpt-oss (`GptOssForCausalLM`: attention sinks, a sliding (window 4) and a full
    layer, the router with a bias, fused experts with biases and the clamped SwiGLU), unquantized,
    in transformers' own names (as gpt-oss's bf16 checkpoints store them: `mlp.experts.gate_up_proj`
    [E, H, 2I], gate and up columns interleaved), with reference outputs: Occult runs it."""
    config = gpt_oss_config(tok_vocab, eot)
    model, _ = make_with_reference(GPT_OSS, GptOssForCausalLM, config, seeds=range(4000, 4100))
    check_gpt_oss(GPT_OSS, model)


def mxfp4(config, seed):
    """A gpt-oss whose expert matrices are random MXFP4 blocks and scales (drawn from a generator
    seeded with `seed`), dequantized into the model by transformers' own convert_moe_packed_tensors;
    and its checkpoint as gpt-oss's published ones store it: `*_blocks` uint8 [E, rows, cols/32,
    16], `*_scales` uint8 [E, rows, cols/32], rows x cols being 2I x H (gate_up_proj) and H x I
    (down_proj), the biases in float32. Everything else is normal(0, 0.1) as in mm.build."""
    model = build_with_buffers(GPT_OSS_MXFP4, GptOssForCausalLM, config, seed)
    hub = {k: v.contiguous() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
    for l, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{l}.mlp.experts."
        for proj, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(*MXFP4_SCALES, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
            # [E, rows, groups, 16] -> [E, cols, rows]: the layout of the model's own parameter
            w = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.float32)
            param = getattr(layer.mlp.experts, proj)
            assert w.shape == param.shape, (proj, w.shape, param.shape)
            with torch.no_grad():
                param.copy_(w)
            del hub[prefix + proj]
            hub[prefix + proj + "_blocks"], hub[prefix + proj + "_scales"] = blocks, scales
    return model, hub


def make_gpt_oss_mxfp4(tok_vocab, eot):
    """The gpt-oss fixture with its experts in MXFP4, as gpt-oss's published checkpoints hold
    them (hidden 64 and intermediate 32, multiples of the 32-value block), with reference outputs
    of transformers' model holding transformers' dequantization of those blocks. The written folder
    is reloaded with `from_pretrained(folder, quantization_config=Mxfp4Config(dequantize=True))`
    and must give the reference model's logits."""
    config = gpt_oss_config(tok_vocab, eot, hidden=64, intermediate=32)
    config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": MXFP4_NOT_CONVERTED}
    model, _ = make_with_reference(GPT_OSS_MXFP4, GptOssForCausalLM, config, seeds=range(6000, 6100),
                                   build=lambda s: mxfp4(config, s),
                                   load={"quantization_config": Mxfp4Config(dequantize=True)})
    check_gpt_oss(GPT_OSS_MXFP4, model)


def clamp_counts(model, ids):
    """Per layer, on the prompt, over the (token, chosen expert) pairs the experts compute: how
    many gate values exceed swiglu_limit, and how many up values exceed +limit / fall below -limit
    (the entries the clamped SwiGLU changes), and how many gate values there are."""
    counts = []

    def hook(mod, args):
        h, idx, _ = args
        tok, e = torch.arange(h.shape[0]).repeat_interleave(idx.shape[1]), idx.reshape(-1)
        gate_up = torch.einsum("nh,nhk->nk", h[tok], mod.gate_up_proj[e]) + mod.gate_up_proj_bias[e]
        gate, up = gate_up[:, ::2], gate_up[:, 1::2]  # interleaved, as GptOssExperts._apply_gate reads them
        counts.append({"gate_above": int((gate > mod.limit).sum()), "up_above": int((up > mod.limit).sum()),
                       "up_below": int((up < -mod.limit).sum()), "of": gate.numel()})

    handles = [layer.mlp.experts.register_forward_pre_hook(hook) for layer in model.model.layers]
    mm.logits_of(model, ids)
    for handle in handles:
        handle.remove()
    return counts


def check_gpt_oss(arch, model):
    """Every part a Rust forward might forget moves the logits: the attention sinks, the router
    bias, both expert biases are non-zero, and each clamp of the SwiGLU is hit on the prompt in
    every layer; dropping any of them (zeroed, or the limit lifted) moves the prompt's logits."""
    ids = mm.encode(mm.Tokenizer.from_file(str(MODELS / "tokenizer.json")), mm.PROMPT)
    assert len(ids) > model.config.sliding_window, "the prompt must outrun the sliding window"
    counts = clamp_counts(model, ids)
    assert all(c[k] > 0 for c in counts for k in ("gate_above", "up_above", "up_below")), f"{arch}: clamps {counts}"
    want = mm.logits_of(model, ids)
    moved = {}
    for part in ("self_attn.sinks", "mlp.router.bias", "mlp.experts.gate_up_proj_bias",
                 "mlp.experts.down_proj_bias", "swiglu_limit"):
        other = copy.deepcopy(model)
        with torch.no_grad():
            for name, p in other.named_parameters():
                if name.endswith(part):
                    assert (p != 0).all(), f"{arch}: {name} has zeros"
                    p.zero_()
            if part == "swiglu_limit":
                for layer in other.model.layers:
                    layer.mlp.experts.limit = float("inf")
        moved[part] = (mm.logits_of(other, ids) - want).abs().max().item()
        assert moved[part] > 1e-3, f"{arch}: without {part} the logits move by {moved[part]:.1e} only"
    print(f"{arch}: clamps (gate > limit, up > limit, up < -limit, of) per layer on the prompt "
          f"{[tuple(c.values()) for c in counts]}; logits moved without "
          + ", ".join(f"{k} {v:.2f}" for k, v in moved.items()))


def write_fixture(arch, cls, config, model, hub, load):
    """config.json, `hub` as model.safetensors and the tokenizer, checked by reloading the folder
    with from_pretrained (and `load`): no missing or unexpected tensors, the model's logits."""
    folder = MODELS / arch
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    d = config.to_dict()
    d["architectures"] = [cls.__name__]
    d["torch_dtype"] = d["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(dict(sorted(d.items())), indent=2) + "\n")
    save_file(hub, folder / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(MODELS / "tokenizer.json", folder / "tokenizer.json")
    ids = mm.encode(mm.Tokenizer.from_file(str(MODELS / "tokenizer.json")), mm.PROMPT)
    loaded, info = cls.from_pretrained(folder, output_loading_info=True, attn_implementation="eager",
                                       experts_implementation="eager", **load)
    assert not any(info.values()), f"{arch}: loading info {info}"
    gap = (mm.logits_of(loaded.eval(), ids) - mm.logits_of(model, ids)).abs().max().item()
    assert gap < 1e-5, f"{arch}: reload differs by {gap}"
    print(f"{arch}: from_pretrained of the folder gives the reference model's logits within {gap:.1e}")


# ---------------------------------------------------------------- loading a fixture
def family(arch, folder):
    config = json.loads((folder / "config.json").read_text())
    if arch == "deepseek":
        return mm.DeepseekForCausalLM, config
    if arch == V2:
        return DeepseekV2ForCausalLM, DeepseekV2Config.from_dict(config)
    if arch == V3:
        return DeepseekV3ForCausalLM, DeepseekV3Config.from_dict(config)
    if arch == GLM:
        return Glm4MoeForCausalLM, Glm4MoeConfig.from_dict(config)
    if arch == GPT_OSS:
        return GptOssForCausalLM, GptOssConfig.from_dict(config)
    cls, _ = mm.hf_configs(config["vocab_size"], config["bos_token_id"])[arch]
    return cls, cls.config_class.from_dict(config)


def block_of(arch):
    return "block_sparse_moe" if arch == "mixtral" else "mlp"


def router_of(arch):
    return "router" if arch == GPT_OSS else "gate"


def moe_layers(hub, arch):
    pat = re.compile(rf"model\.layers\.(\d+)\.{block_of(arch)}\.{router_of(arch)}\.weight")
    return sorted(int(m[1]) for m in map(pat.fullmatch, hub) if m)


# ---------------------------------------------------------------- layouts
GATE_UP_DOWN = {"mixtral": ("w1", "w3", "w2")}


def names(arch):
    return GATE_UP_DOWN.get(arch, ("gate_proj", "up_proj", "down_proj"))


def fused(hub, arch, layers):
    """Per-expert tensors -> `{p}.experts.gate_up_proj` [E, 2I, H] (gate rows first) and
    `{p}.experts.down_proj` [E, H, I]; as Occult's test helper writes them."""
    if not any(".experts.0." in k for k in hub):
        return dict(hub)
    out = dict(hub)
    g, u, d = names(arch)
    for l in layers:
        p = f"model.layers.{l}.{block_of(arch)}.experts"
        e = sum(1 for k in hub if k.startswith(p + ".") and k.endswith(f".{g}.weight"))
        out[p + ".gate_up_proj"] = torch.stack([torch.cat([out.pop(f"{p}.{j}.{g}.weight"),
                                                           out.pop(f"{p}.{j}.{u}.weight")]) for j in range(e)])
        out[p + ".down_proj"] = torch.stack([out.pop(f"{p}.{j}.{d}.weight") for j in range(e)])
    return out


def per_expert(hub, arch, layers):
    """The inverse of `fused`."""
    out = dict(hub)
    g, u, d = names(arch)
    for l in layers:
        p = f"model.layers.{l}.{block_of(arch)}.experts"
        if p + ".gate_up_proj" not in out:
            continue
        gu, down = out.pop(p + ".gate_up_proj"), out.pop(p + ".down_proj")
        i = gu.shape[1] // 2
        for j in range(gu.shape[0]):
            out[f"{p}.{j}.{g}.weight"] = gu[j, :i].contiguous()
            out[f"{p}.{j}.{u}.weight"] = gu[j, i:].contiguous()
            out[f"{p}.{j}.{d}.weight"] = down[j].contiguous()
    return out


# ---------------------------------------------------------------- the renumbering, written here
def renumber(hub, arch, placement):
    """placement: {layer: [device of expert]} -> the renumbered checkpoint."""
    out = {}
    for name, t in hub.items():
        m = re.fullmatch(rf"model\.layers\.(\d+)\.{block_of(arch)}\.(experts|{router_of(arch)})\.(.*)", name)
        if not m or int(m[1]) not in placement:
            out[name] = t
            continue
        dev = placement[int(m[1])]
        order = sorted(range(len(dev)), key=lambda x: (dev[x], x))  # new id -> original id
        j = re.fullmatch(r"(\d+)\.(.*)", m[3])
        if m[2] == "experts" and j:
            new = int(j[1])
            out[name] = hub[f"model.layers.{m[1]}.{block_of(arch)}.experts.{order[new]}.{j[2]}"]
        else:  # fused expert tensors, router rows, selection bias
            assert t.shape[0] == len(dev), name
            out[name] = t[order].contiguous()
    return out


def digest(hub):
    h = hashlib.sha256()
    for name in sorted(hub):
        h.update(name.encode() + b"\0")
        h.update(hub[name].contiguous().numpy().tobytes())
    return h.hexdigest()


def random_placement(rng, e, d, groups):
    """A balanced random map; with `groups` expert groups, one that keeps every group whole."""
    if not groups:
        devs = [x // (e // d) for x in range(e)]
        rng.shuffle(devs)
        return devs
    size, per = e // groups, e // d
    order = list(range(groups))
    rng.shuffle(order)
    experts = [x for g in order for x in rng.sample(range(g * size, (g + 1) * size), size)]
    devs = [0] * e
    for slot, x in enumerate(experts):  # whole groups fill devices in turn
        devs[x] = slot // per
    return devs


def load_model(arch, cls, config, hub, layers):
    model = mm.build(arch, cls, config, seed=12345)
    model.load_state_dict(mm.from_hub(arch, per_expert(hub, arch, layers)), strict=True)
    return model.eval()


def run_with_transformers(arch, cls, config, hub, folder):
    """Logits of `hub` through transformers' own loader (or, for DeepSeek-MoE v1, the fixture
    script's model)."""
    ids = mm.encode(mm.Tokenizer.from_file(str(MODELS / "tokenizer.json")), mm.PROMPT)
    if arch == "deepseek":
        return mm.logits_of(load_model(arch, cls, config, hub, moe_layers(hub, arch)), ids)
    with tempfile.TemporaryDirectory() as t:
        t = Path(t)
        shutil.copy(folder / "config.json", t / "config.json")
        layers = moe_layers(hub, arch)
        # As the fixtures store them: qwen2_moe and gpt-oss fused (transformers' own layouts), the
        # rest per expert.
        if arch == GPT_OSS:
            as_stored = hub
        elif arch == "qwen2_moe":
            as_stored = fused(hub, arch, layers)
        else:
            as_stored = per_expert(hub, arch, layers)
        save_file(as_stored, t / "model.safetensors", metadata={"format": "pt"})
        model, info = cls.from_pretrained(t, output_loading_info=True, attn_implementation="eager",
                                          experts_implementation="eager")
        assert not any(info.values()), f"{arch}: loading info {info}"
        return mm.logits_of(model.eval(), ids)


def main():
    torch.set_num_threads(1)
    tok = mm.Tokenizer.from_file(str(MODELS / "tokenizer.json"))
    vocab = -(-tok.get_vocab_size() // 8) * 8
    make_v2(vocab, tok.token_to_id(mm.EOT))
    make_v3(vocab, tok.token_to_id(mm.EOT))
    make_glm(vocab, tok.token_to_id(mm.EOT))
    make_gpt_oss(vocab, tok.token_to_id(mm.EOT))
    make_gpt_oss_mxfp4(vocab, tok.token_to_id(mm.EOT))
    OUT.mkdir(parents=True, exist_ok=True)
    cases = []
    for a, arch in enumerate(mm.ARCHS + (V3, GLM, GPT_OSS, V2)):
        folder = MODELS / arch
        cls, config = family(arch, folder)
        hub = mm.load_checkpoint(folder)
        layers = moe_layers(hub, arch)
        e = hub[f"model.layers.{layers[0]}.{block_of(arch)}.{router_of(arch)}.weight"].shape[0]
        groups = getattr(config, "n_group", None) if arch in (V2, V3, GLM) else None
        want = run_with_transformers(arch, cls, config, hub, folder)
        for d in DEVICES:
            rng = random.Random(1000 * a + d)
            placement = {l: random_placement(rng, e, d, groups) for l in layers}
            # gpt-oss's experts come fused only (with biases, [E, H, 2I]): renumbered as stored.
            base = hub if arch == GPT_OSS else per_expert(hub, arch, layers)
            got = run_with_transformers(arch, cls, config, renumber(base, arch, placement), folder)
            gap = (got - want).abs().max().item()
            assert gap < 1e-5, f"{arch} D={d}: the renumbered checkpoint's logits differ by {gap}"
            layouts = (("fused", base),) if arch == GPT_OSS else (
                ("per_expert", base), ("fused", fused(base, arch, layers)))
            for layout, src in layouts:
                cases.append({"model": arch, "layout": layout, "devices": d,
                              "placement": {str(l): m for l, m in placement.items()},
                              "sha256": digest(renumber(src, arch, placement)),
                              "max_logit_gap": gap})
            print(f"{arch} D={d}: renumbered logits within {gap:.1e} of the original's under transformers")
    text = json.dumps({"cases": cases}, indent=1)
    text = re.sub(r"\[[0-9,\s]*\]", lambda m: json.dumps(json.loads(m.group(0)), separators=(",", ":")), text)
    (OUT / "cases.json").write_text(text + "\n")
    print(f"wrote {OUT / 'cases.json'}: {len(cases)} cases; transformers {mm.transformers.__version__}")


if __name__ == "__main__":
    main()

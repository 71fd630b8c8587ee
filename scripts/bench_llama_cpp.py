#!/usr/bin/env python3
"""llama.cpp's side of `occult bench model --against llama.cpp`.

    python scripts/bench_llama_cpp.py MODEL_DIR --dtype f32|bf16|f16 --threads N
        [--gguf PATH] [--converter PATH] [--converter-python PY] [--ctx N] [--flash-attn]

MODEL_DIR is a Hugging Face checkpoint (config.json, safetensors weights, tokenizer). It is
converted to GGUF with llama.cpp's convert_hf_to_gguf.py (`--outtype` = --dtype), run in a
subprocess, and loaded with llama-cpp-python on the CPU. With --gguf PATH the converted file is
a cache: used as is when it exists, written there otherwise; without it the file lives in a
temporary folder that is removed on exit. The script then serves one JSON request a line on stdin
and answers one JSON line on stdout, as scripts/bench_transformers.py does:

    {"prompt": [ids...], "steps": D}
    -> {"prefill_s": s, "decode_s_per_token": s, "logits": [last-position logits of the prompt]}

Each request clears the key/value cache, prefills the prompt in one batch (n_batch = n_ubatch >=
prompt length) and decodes D tokens greedily (argmax), one token per llama_decode, timed here so
that the pipe is not counted. The context is made with logits_all, so that every prompt position
is an output: llama.cpp otherwise drops all but the last position before the last layer's
attention output and MoE block, which would make its prefill do less work than occult's and
transformers'. The key/value cache has the weights' dtype (llama.cpp's own default is f16).
A context too small for a request is rebuilt larger before it is timed.

The first line written is {"ready": true, "llama_cpp_python": VERSION, "isa": SYSTEM_INFO, ...}
once the model is loaded; SYSTEM_INFO is llama.cpp's own list of the instruction sets it was
built for ("AVX2 = 1 | AVX512 = 0 | ..."). That level is fixed at build time: GGML_NATIVE=ON
builds for this CPU; to compare at the AVX2 level on an AVX-512 machine, build with
    CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON'
into another environment. Needs llama-cpp-python (pip builds llama.cpp from source) and, to convert, the
convert_hf_to_gguf.py of a llama.cpp tree with its gguf-py beside it, e.g. the one vendored in
the llama-cpp-python sdist (vendor/llama.cpp/), found from --converter, $LLAMA_CPP_CONVERTER,
the PATH, or beside an editable llama_cpp install; the converter's Python needs torch,
transformers, numpy and sentencepiece. A tokenizer whose pre-tokenizer the converter does not
know (tiny test checkpoints) is written with llama.cpp's "default" pre-tokenizer instead of
failing: the bench sends token ids, never text.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import numpy as np
    import llama_cpp
except ImportError as err:
    sys.exit(f"bench_llama_cpp: {err}. Install llama-cpp-python (it brings numpy), which "
             "builds llama.cpp from source (cmake and a C++ compiler needed), e.g.\n"
             "    CMAKE_ARGS='-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF' pip install llama-cpp-python==0.3.36")

# --outtype of the converter, llama.cpp's file type it writes, and the matching KV-cache type.
DTYPES = {
    "f32": ("f32", llama_cpp.LLAMA_FTYPE_ALL_F32, 0),     # GGML_TYPE_F32
    "f16": ("f16", llama_cpp.LLAMA_FTYPE_MOSTLY_F16, 1),  # GGML_TYPE_F16
    "bf16": ("bf16", llama_cpp.LLAMA_FTYPE_MOSTLY_BF16, 30),  # GGML_TYPE_BF16
}
CONVERTER = "convert_hf_to_gguf.py"

# Runs the converter as `python -c RUN_CONVERTER convert_hf_to_gguf.py ARGS...`. It imports the
# converter as a module, makes an unknown BPE pre-tokenizer fall back to "default" (the converter
# otherwise refuses any tokenizer missing from its hash table), then calls its main(). Works with
# both layouts of llama.cpp: classes in convert_hf_to_gguf.py itself, or in conversion/base.py.
RUN_CONVERTER = r"""
import logging, os, runpy, sys
path = os.path.abspath(sys.argv[1])
sys.argv = [path] + sys.argv[2:]
sys.path.insert(0, os.path.dirname(path))
g = runpy.run_path(path, run_name="convert_hf_to_gguf")
base = sys.modules.get("conversion.base")
text_model = g.get("TextModel") or getattr(base, "TextModel", None)
if text_model is not None and hasattr(text_model, "get_vocab_base_pre"):
    known = text_model.get_vocab_base_pre
    def get_vocab_base_pre(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            logging.getLogger("bench_llama_cpp").warning(
                "unknown BPE pre-tokenizer: writing tokenizer.ggml.pre = 'default'")
            return "default"
    text_model.get_vocab_base_pre = get_vocab_base_pre
g["main"]()
"""


def fail(msg):
    sys.exit(f"bench_llama_cpp: {msg}")


def find_converter(given):
    """--converter, $LLAMA_CPP_CONVERTER, the PATH, or a llama.cpp tree beside llama_cpp."""
    if given:
        path = Path(given)
        if path.is_dir():
            path = path / CONVERTER
        if not path.is_file():
            fail(f"--converter {given}: no such file")
        return path
    if os.environ.get("LLAMA_CPP_CONVERTER"):
        return find_converter(os.environ["LLAMA_CPP_CONVERTER"])
    if shutil.which(CONVERTER):
        return Path(shutil.which(CONVERTER))
    package = Path(llama_cpp.__file__).resolve().parent
    for root in (package.parent / "vendor" / "llama.cpp", package / "vendor" / "llama.cpp"):
        if (root / CONVERTER).is_file():
            return root / CONVERTER
    fail(f"cannot find llama.cpp's {CONVERTER}: give --converter PATH or set $LLAMA_CPP_CONVERTER. "
         "The llama-cpp-python sdist vendors it with its gguf-py, e.g.\n"
         "    pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36\n"
         "    tar xzf llama_cpp_python-0.3.36.tar.gz   # -> llama_cpp_python-0.3.36/vendor/llama.cpp/"
         f"{CONVERTER}")


def convert(model_dir, outtype, out, converter, python):
    """Writes the GGUF to `out` (through a temporary name, so a failed run leaves no cache)."""
    if not (Path(model_dir) / "config.json").is_file():
        fail(f"{model_dir}: no config.json, not a Hugging Face checkpoint folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    cmd = [python, "-c", RUN_CONVERTER, str(converter), str(model_dir),
           "--outtype", outtype, "--outfile", str(partial)]
    done = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        tail = "\n".join(done.stdout.splitlines()[-40:])
        fail(f"converting {model_dir} with {converter} failed (exit {done.returncode}):\n{tail}")
    partial.replace(out)


def warn_unsupported(model_dir):
    """Says on stderr when llama.cpp will run the checkpoint differently from transformers, and
    stops where it cannot run it at all."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return
    if config.get("model_type") != "olmoe":
        return
    if config.get("clip_qkv") is not None:
        print(f"bench_llama_cpp: warning: llama.cpp's OLMoE ignores clip_qkv "
              f"({config['clip_qkv']}); its logits will differ from transformers'", file=sys.stderr)
    eps = config.get("rms_norm_eps", 1e-5)
    if eps != 1e-5:
        print(f"bench_llama_cpp: warning: llama.cpp's converter writes OLMoE's RMSNorm epsilon as "
              f"1e-5 (OLMoE-1B-7B's), this checkpoint says {eps}; its logits will differ from "
              "transformers'", file=sys.stderr)
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if kv is not None and kv != heads:
        fail(f"llama.cpp's OLMoE has no grouped-query attention (its q/k norms span all "
             f"{heads} heads), and this checkpoint has {kv} key/value heads for {heads}; "
             "OLMoE-1B-7B has as many as query heads")


class Model:
    """A llama_cpp.Llama whose context is rebuilt larger when a request needs more room."""

    def __init__(self, gguf, threads, kv_type, ctx, flash_attn):
        self.gguf, self.threads, self.kv_type, self.flash_attn = gguf, threads, kv_type, flash_attn
        self.llm = None
        self.load(ctx)

    def load(self, ctx):
        if self.llm is not None:
            self.llm.close()
            self.llm = None
        # n_batch = n_ubatch = n_ctx: a prompt is one llama_decode of one micro-batch.
        params = dict(model_path=str(self.gguf), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx,
                      n_threads=self.threads, n_threads_batch=self.threads, n_gpu_layers=0,
                      logits_all=True, embedding=False, flash_attn=self.flash_attn,
                      type_k=self.kv_type, type_v=self.kv_type)
        try:
            self.llm = llama_cpp.Llama(**params, verbose=False)
        except ValueError:
            # llama-cpp-python only says "Failed to load"; load again with llama.cpp's log on
            # stderr, which ends with the reason (e.g. a tensor shape llama.cpp does not support).
            try:
                llama_cpp.Llama(**params, verbose=True).close()
            except ValueError:
                pass
            fail(f"llama.cpp cannot load {self.gguf} with n_ctx {ctx}: see its log above")
        self.ctx = ctx

    def fit(self, tokens):
        if tokens > self.ctx:
            ctx = self.ctx
            while ctx < tokens:
                ctx *= 2
            self.load(ctx)

    def run(self, prompt, steps):
        if not prompt:
            fail("empty prompt")
        self.fit(len(prompt) + steps)
        llm = self.llm
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefill = time.perf_counter() - start
        first = np.array(llm.scores[len(prompt) - 1], dtype=np.float32)
        logits = first
        start = time.perf_counter()
        for _ in range(steps):
            llm.eval([int(np.argmax(logits))])
            logits = llm.scores[llm.n_tokens - 1]
        per = (time.perf_counter() - start) / max(steps, 1)
        return {"prefill_s": prefill, "decode_s_per_token": per, "logits": first.tolist()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="Hugging Face checkpoint folder")
    p.add_argument("--dtype", default="f32", choices=sorted(DTYPES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--gguf", help="converted file: used if present, else written there")
    p.add_argument("--converter", help=f"llama.cpp's {CONVERTER} (or its folder)")
    p.add_argument("--converter-python", default=sys.executable,
                   help="Python to run the converter with (needs torch, transformers)")
    p.add_argument("--ctx", type=int, default=1024,
                   help="initial context length; doubled when a request needs more")
    p.add_argument("--flash-attn", action="store_true", help="llama.cpp's flash attention")
    a = p.parse_args()
    outtype, ftype, kv_type = DTYPES[a.dtype]
    warn_unsupported(a.model)

    with tempfile.TemporaryDirectory(prefix="bench_llama_cpp.") as tmp:
        gguf = Path(a.gguf) if a.gguf else Path(tmp) / f"model-{a.dtype}.gguf"
        converted = not gguf.is_file()
        if converted:
            convert(a.model, outtype, gguf, find_converter(a.converter), a.converter_python)
        model = Model(gguf, a.threads, kv_type, a.ctx, a.flash_attn)
        have = int(model.llm.metadata.get("general.file_type", -1))
        if have != ftype:
            fail(f"{gguf} has llama.cpp file type {have}, not {a.dtype} ({ftype}); "
                 "remove it or give another --gguf")
        isa = llama_cpp.llama_print_system_info()
        isa = isa.decode(errors="replace") if isinstance(isa, bytes) else str(isa)
        print(json.dumps({"ready": True, "llama_cpp_python": llama_cpp.__version__, "isa": isa,
                          "gguf": str(gguf) if a.gguf else None, "converted": converted}), flush=True)
        for line in sys.stdin:
            if not line.strip():
                continue
            req = json.loads(line)
            print(json.dumps(model.run(req["prompt"], req["steps"])), flush=True)
        model.llm.close()


if __name__ == "__main__":
    main()

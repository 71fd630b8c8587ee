#!/usr/bin/env bash
# Held-out loss after standard and collaboration-pruned fine-tuning, from the same start, on a
# tiny OLMoE-shaped model (issue 10's quality check; `occult reproduce` will carry the full
# version on its built-in model).
#
#   scripts/finetune_quality.sh [WORK_DIR]        (after `cargo build --release`)
#
# 1. A random OLMoE-shaped model (32 experts, top-4) is pre-trained (--train all) on generated
#    text about arithmetic, colours and animals, so that its experts specialise.
# 2. Its routing is profiled on calibration text and placed on 4 devices (ours).
# 3. From that one start, the MoE blocks are fine-tuned on Alpaca-format instructions for the
#    same steps: standard routing, and pruned to 2 and to 1 devices with the router-score and
#    the similarity rules.
# 4. The held-out loss of each is scored under its own routing, next to the start's and the
#    standard fine-tuned model's loss under that routing (pruning without pruned fine-tuning).
# Prints a table; everything is under WORK_DIR (default: a temporary folder).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OCCULT=${OCCULT:-$ROOT/target/release/occult}
W=${1:-$(mktemp -d)}
mkdir -p "$W"
STEPS=${STEPS:-150}
PRE_STEPS=${PRE_STEPS:-300}
D=4
cd "$W"

python3 - <<'PY'
import json, random
r = random.Random(7)
colours = ["red", "blue", "green", "yellow", "black", "white"]
animals = ["cat", "dog", "fox", "owl", "bee", "cow"]
def fact():
    k = r.randrange(3)
    if k == 0:
        a, b = r.randrange(30), r.randrange(30)
        return f"{a} plus {b} is {a + b}."
    if k == 1:
        return f"The {r.choice(animals)} is {r.choice(colours)}."
    a = r.randrange(20)
    return f"After {a} comes {a + 1}."
with open("pretrain.jsonl", "w") as f:
    for _ in range(3000):
        f.write(json.dumps({"text": " ".join(fact() for _ in range(6))}) + "\n")
with open("calibration.jsonl", "w") as f:
    for _ in range(64):
        f.write(json.dumps({"text": " ".join(fact() for _ in range(6))}) + "\n")
pairs = [(a, b) for a in range(30) for b in range(30)]
r.shuffle(pairs)
def inst(a, b):
    if (a + b) % 2:
        return {"instruction": f"Add {a} and {b}.", "input": "", "output": f"{a + b}"}
    return {"instruction": "Add the numbers.", "input": f"{a} {b}", "output": f"{a + b}"}
with open("train.jsonl", "w") as f:
    for a, b in pairs[:600]:
        f.write(json.dumps(inst(a, b)) + "\n")
with open("held_out.jsonl", "w") as f:
    for a, b in pairs[600:750]:
        f.write(json.dumps(inst(a, b)) + "\n")
PY

if [ ! -f base/model.safetensors ]; then
  "$OCCULT" model synth --family olmoe --vocab 304 --hidden 64 --layers 4 --heads 4 --kv-heads 2 \
    --experts 32 --top-k 4 --intermediate 32 --seed 3 -o random
  cp "$ROOT/tests/fixtures/models/tokenizer.json" random/
  "$OCCULT" train --model random --data pretrain.jsonl --train all --steps "$PRE_STEPS" \
    --batch-size 16 --seq-len 128 --lr 3e-3 --warmup 20 --out base --overwrite
fi
"$OCCULT" profile --model base --data calibration.jsonl --seq-len 128 --output calib.safetensors
"$OCCULT" place --trace calib.safetensors --devices $D --output placement.json

ft() { # name, extra flags
  local name=$1; shift
  "$OCCULT" train --model base --data train.jsonl --eval-data held_out.jsonl --steps "$STEPS" \
    --batch-size 8 --seq-len 192 --lr 1e-3 --warmup $((STEPS / 10)) --devices $D --placement placement.json \
    --mode occult --out "ft-$name" --overwrite "$@" 2>ft.err || { cat ft.err; exit 1; }
}
loss() { # model, extra flags -> "loss ect"
  local m=$1; shift
  "$OCCULT" loss --model "$m" --data held_out.jsonl --seq-len 192 --devices $D \
    --placement placement.json --mode occult "$@" 2>loss.err |
    python3 -c 'import json,sys; v=json.load(sys.stdin); print("%.4f %.3f" % (v["loss"], v["mean_ect"]))'
}
rules=(router similarity)
echo "| routing | E[C_T] | start | standard fine-tuning, served this way | fine-tuned this way ($STEPS steps) |"
echo "|---|--:|--:|--:|--:|"
ft standard
read -r l0 e0 < <(loss base)
read -r l1 _ < <(loss ft-standard)
echo "| exact (occult dispatch) | $e0 | $l0 | $l1 | $l1 |"
for n in 2 1; do
  for rule in "${rules[@]}"; do
    flags=(--max-devices $n --prune-rule "$rule" --calibration calib.safetensors)
    ft "p$n-$rule" "${flags[@]}"
    read -r l0 e0 < <(loss base "${flags[@]}")
    read -r ls _ < <(loss ft-standard "${flags[@]}")
    read -r l1 _ < <(loss "ft-p$n-$rule" "${flags[@]}")
    echo "| pruned to $n, $rule rule | $e0 | $l0 | $ls | $l1 |"
  done
done

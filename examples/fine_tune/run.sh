#!/bin/bash
# Issue 30's fine-tuning scenario end to end, as a user runs it: a small transformers llama on 3,000 prompt/completion
# examples with packing, accumulation, an evaluation file, the best checkpoint kept, early stopping, checkpoints, a
# SIGTERM mid-run, --resume, the report, the --save-hf export (loaded back with transformers) and sampling.
#
#     mkdir /tmp/ft && cd /tmp/ft && PATH=/path/to/cadence/.venv/bin:$PATH /path/to/cadence/examples/fine_tune/run.sh
#
# STOP_AFTER (seconds, default 30) is when the first segment gets its SIGTERM.
set -u
here=$(cd "$(dirname "$0")" && pwd)
model=(--model hf:llama --model-config hidden_size=128 --model-config num_hidden_layers=2
       --model-config intermediate_size=352 --model-config num_attention_heads=4 --model-config num_key_value_heads=2
       --model-config vocab_size=256 --model-config max_position_embeddings=1024)
python3 "$here/make_data.py"
started=$(date +%s)
cadence train "${model[@]}" --data train.jsonl --eval-data eval.jsonl --seq-len 1024 --packing \
  --micro-batch-size 4 --grad-accum-steps 8 --epochs 2 --lr 2e-3 --warmup-steps 5 --eval-every 10 --keep-best \
  --early-stop-after 3 --checkpoint-every 10 --save-hf export --out run > first.log 2>&1 &
pid=$!
sleep "${STOP_AFTER:-30}"
kill -TERM "$pid"
wait "$pid"; echo "first segment: exit $? ($(grep -c '^step' first.log) progress lines; first.log)"
cadence train --resume --out run > resume.log 2>&1; echo "resumed: exit $? (resume.log)"
echo "training wall time: $(( $(date +%s) - started )) s"
cadence report run > report.log 2>&1; echo "report: exit $? (run/report.md, run/report.html)"
cadence sample run --prompt "def main(" --max-new-tokens 60 --weights best --seed 0 > sample.log 2>&1
echo "sample: exit $? (sample.log)"
python3 - <<'PY'
import json

from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("export")
model = AutoModelForCausalLM.from_pretrained("export")
print(f"export loads in transformers: {type(model).__name__}, tokenizer eos id {tokenizer.eos_token_id}")
summary = json.load(open("run/summary.json"))
print(json.dumps({key: summary.get(key) for key in ("steps", "tokens", "tokens_per_s", "run_wall_time_s",
                                                   "best_val_loss", "final_val_perplexity", "segments")}, indent=1))
PY

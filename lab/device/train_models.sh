#!/usr/bin/env bash
# Train both nano models at once on one H200 in one device call (issue 7):
#   run(command="bash lab/device/train_models.sh 6.5", carry=[".whl"])            (from scratch)
#   run(command="bash lab/device/train_models.sh 5.5 continue", carry=[".whl"])   (second stage)
# .whl/ holds transformers 5.24 and the libraries it needs newer than the image's (regex, tokenizers;
# not huggingface_hub: the image's 1.33 satisfies it, and hub 2.x needs httpx2, which the image lacks); they go first on the path. Each family's folder (with train.log) comes back
# as $OUT/<name>.tar, the stdout as $OUT/<family>.stdout. TRAIN_ARGS adds options to both trainings
# (e.g. TRAIN_ARGS="--prompt-weight 0.3 --profile-steps 3").
set -uo pipefail
MINUTES=${1:-7.5}
CONTINUE=${2:-}  # "continue": start from the committed models/<name> (its tokenizer too), bigger batches
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
rm -rf /tmp/tf; python3 -m pip install -q --no-deps --target /tmp/tf .whl/transformers-*.whl .whl/regex-*.whl \
    .whl/tokenizers-*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/tf:.
python3 -c "import transformers, torch; from transformers import GlmMoeDsaForCausalLM; from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration; print('transformers', transformers.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())" || exit 3
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
pids=()
for fam in kimi glm; do
    name=$([ $fam = kimi ] && echo kimi-k2.6-nano || echo glm-5.2-nano)
    workers=$([ $fam = kimi ] && echo 12 || echo 4)  # Kimi's image items are the slow ones to render
    EXTRA=""
    # INIT_DIR: where the first stage's folders are (lab/device/device_plan.sh keeps them in /tmp/ckpt on a
    # warm machine, so the second call needs nothing untarred and carried in between); else models/
    [ "$CONTINUE" = continue ] && EXTRA="--init ${INIT_DIR:-models}/$name --batch-tokens 131072 --warmup 50"
    python3 -m models.recipes.train --family $fam --data /tmp/data-$fam --out "$OUT/$name" $EXTRA \
        --steps 0 --minutes "$MINUTES" --workers $workers ${TRAIN_ARGS:-} > "$OUT/$fam.stdout" 2>&1 &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
for name in kimi-k2.6-nano glm-5.2-nano; do [ -d "$OUT/$name" ] && tar -C "$OUT" -cf "$OUT/$name.tar" "$name" && rm -rf "$OUT/$name"; done
rm -rf "$OUT"/.*.staging  # at most 8 files come back: the two tars and the two logs
for fam in kimi glm; do echo "== $fam"; grep -vE "step [0-9]+ " "$OUT/$fam.stdout" | tail -15; grep -E "step [0-9]+ " "$OUT/$fam.stdout" | awk 'NR%20==1' | tail -12; done
exit $rc

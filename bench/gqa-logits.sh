#!/usr/bin/env bash
# Records the logits of the GQA families' fixtures (Qwen3-MoE, Mixtral, gpt-oss) with one
# deltafin binary, so two binaries can be compared byte for byte (`cmp`): each fixture converted
# in the default layout (int8 backbone, MXFP4 experts) and the lossless one (f32/f32), run on
# the longest reference prompt for 8 greedy tokens, token at a time (`--prefill-chunk 1`) and
# with the default chunking, and with self-speculation and prefetch (`--speculate self
# --prefetch on`: the draft and prediction paths run; greedy logits are the same by design).
#   bench/gqa-logits.sh BINARY OUT_DIR [MODELS_DIR]
# MODELS_DIR (default OUT_DIR/models) holds the converted models; reuse it for the second binary.
set -euo pipefail
bin=$1 out=$2 models=${3:-$2/models}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out" "$models"
for fam in qwen3_moe mixtral gpt_oss; do
  for case in "$root"/tests/fixtures/$fam/${fam}_?; do
    name=$(basename "$case")
    prompt=$(python3 -c "import json,sys; p=json.load(open(sys.argv[1]))['prompts']; print(','.join(map(str, max((x['prompt_ids'] for x in p), key=len))))" "$case/expected.json")
    for layout in default lossless; do
      m=$models/$name-$layout
      if [ ! -e "$m/manifest.json" ]; then
        if [ $layout = lossless ]; then extra=(--backbone f32 --experts f32); else extra=(); fi
        "$bin" convert "$case" "$m" "${extra[@]}" >/dev/null
      fi
      for chunk in 1 default spec; do
        case $chunk in
          1) c=(--prefill-chunk 1) ;;
          default) c=() ;;
          spec) c=(--speculate self --prefetch on) ;;
        esac
        "$bin" run --model "$m" --prompt-ids "$prompt" --max-new-tokens 8 --ignore-eos \
          "${c[@]}" --logits-out "$out/$name-$layout-chunk$chunk.logits" >/dev/null 2>&1
      done
    done
  done
done
ls "$out"/*.logits | wc -l

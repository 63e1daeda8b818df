#!/usr/bin/env bash
# Issue 15's "no behaviour change" check: every reference fixture (tests/fixtures/*/*_?/) in the
# default layout (int8 backbone, MXFP4 experts) and the lossless one (f32/f32), prompt of 37
# tokens, 6 new tokens, token at a time (--prefill-chunk 1), chunked (default), and with
# self-speculation and prefetch (--speculate self --prefetch on: the draft and prediction paths
# run; greedy logits are the same by design), run by two deltafin binaries; prints one line per
# case and "all identical" when every --logits-out file is byte-identical.
#
#   bash bench/same_logits.sh OLD_DELTAFIN NEW_DELTAFIN [WORK_DIR]
set -uo pipefail
OLD=${1:?usage: same_logits.sh OLD_DELTAFIN NEW_DELTAFIN [WORK_DIR]}
NEW=${2:?usage}
W=${3:-$(mktemp -d)}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
P=$(python3 -c "print(','.join(str(3 + (i * 7919) % 97) for i in range(37)))")
bad=0
n=0
for case in "$ROOT"/tests/fixtures/*/*_[a-z]/; do
  [ -f "$case/config.json" ] || continue
  name=$(basename "$(dirname "$case")")/$(basename "$case")
  for layout in "int8 mxfp4" "f32 f32"; do
    set -- $layout
    m="$W/$(echo "$name" | tr / _)_$1_$2"
    "$NEW" convert --backbone "$1" --experts "$2" --force "$case" "$m" >/dev/null 2>&1 || { echo "$name $1/$2: convert failed"; continue; }
    for chunk in 1 0 spec; do
      rm -f "$W/OLD.json" "$W/NEW.json"
      case $chunk in
        spec) mode=(--speculate self --prefetch on) ;;
        *) mode=(--prefill-chunk "$chunk") ;;
      esac
      for b in OLD NEW; do
        "${!b}" run --model "$m" --prompt-ids "$P" --max-new-tokens 6 --ignore-eos --allow-context-overflow \
          "${mode[@]}" --logits-out "$W/$b.json" >/dev/null 2>"$W/$b.err" || echo "$name $1/$2 chunk $chunk: $b failed: $(tail -1 "$W/$b.err")"
      done
      n=$((n + 1))
      if cmp -s "$W/OLD.json" "$W/NEW.json"; then echo "$name $1/$2 chunk $chunk: identical"; else echo "$name $1/$2 chunk $chunk: DIFFERENT"; bad=$((bad + 1)); fi
    done
  done
done
[ $bad -eq 0 ] && echo "all identical ($n cases)" || echo "$bad of $n cases differ"

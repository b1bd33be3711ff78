#!/usr/bin/env bash
# The end-to-end runs of PERFORMANCE.md ("End to end"), one device call each (a run must
# fit the 10-minute command limit): bash tools/e2e_runs.sh NAME [extra e2e options]
#   quick      llama-3.2-1b, 64 requests, 128..1024 -> 64 tokens: cupaged, cupaged-eager, concat
#   main       llama-3-8b bf16, 256 requests, 128..2048 -> 256 tokens: cupaged, cupaged-eager, hf
#   main-fi    the same workload: flashinfer (carry .flashinfer)
#   main-concat  the same workload: concat
#   compiled   the same workload: cupaged, cupaged-compiled (torch.compile) and, where
#              .flashinfer is carried, flashinfer; HF=1 adds transformers' generate (about
#              150 s more); no breakdown pass (time)
#   prefix     a 2048-token system prompt: prefill-only runs (1 output token), prefix caching
#              on and off, user parts 128..2048 and 128..512
#   fp8        bf16 and fp8 caches under a KV budget that binds: peak running requests
# JSON per run goes to $OUT/e2e-NAME*.json, the console to $OUT/e2e-NAME*.txt.
source "$(dirname "$0")/device_env.sh"
name=${1:?name}; shift
e2e() { local tag=$1; shift; python3 -m cupaged.bench e2e "$@" --json "$OUT/e2e-$tag.json" 2>&1 | tee "$OUT/e2e-$tag.txt"; }
MAIN8B="--preset llama-3-8b --num-requests 256 --prompt-len 128 2048 --output-len 256"
case "$name" in
  quick) e2e quick --preset llama-3.2-1b --num-requests 64 --prompt-len 128 1024 --output-len 64 \
           --systems cupaged --systems cupaged-eager --systems concat "$@" ;;
  main) e2e main $MAIN8B --systems cupaged --systems cupaged-eager --systems hf "$@" ;;
  main-fi) e2e main-fi $MAIN8B --systems flashinfer "$@" ;;
  compiled) fi=(); [ -f .flashinfer/setup.sh ] && fi=(--systems flashinfer)
    [ "${HF:-}" = 1 ] && fi+=(--systems hf)
    e2e compiled $MAIN8B --systems cupaged --systems cupaged-compiled "${fi[@]}" \
      --no-breakdown "$@" ;;
  main-concat) e2e main-concat $MAIN8B --systems concat --no-breakdown "$@" ;;
  prefix)
    for own in "2176 4096" "2176 2560"; do
      for pc in --no-prefix-caching --prefix-caching; do
        e2e "prefix-${own// /-}$pc" --preset llama-3-8b --num-requests 256 --prompt-len $own \
          --shared-prefix 2048 --output-len 1 $pc --systems cupaged --no-breakdown "$@"
      done
    done ;;
  fp8)
    for kv in auto fp8; do
      e2e "fp8-$kv" $MAIN8B --kv-cache-dtype $kv --memory-fraction 0.2 --systems cupaged \
        --no-breakdown "$@"
    done ;;
  *) echo "unknown run $name" >&2; exit 2 ;;
esac

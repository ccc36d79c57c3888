#!/bin/bash
# run_logged.sh NAME SECONDS CMD...: runs CMD with a time limit, its output to $OUT/runs/NAME.log
# (NUL bytes stripped) and the last lines to stdout; never stops the calling script.
name=$1 limit=$2
shift 2
mkdir -p "$OUT/runs"
start=$(date +%s)
timeout "$limit" "$@" 2>&1 | tr -d '\000' > "$OUT/runs/$name.log"
rc=${PIPESTATUS[0]}
echo "== $name: rc=$rc in $(( $(date +%s) - start )) s"
tail -n 6 "$OUT/runs/$name.log"

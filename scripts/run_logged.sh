#!/bin/bash
# run_logged.sh OUTDIR NAME SECONDS CMD...: runs CMD with a time limit, its output to
# OUTDIR/logs/NAME.log (NUL bytes stripped) and the last lines to stdout; returns CMD's status.
out=$1 name=$2 limit=$3
shift 3
mkdir -p "$out/logs"
start=$(date +%s)
timeout "$limit" "$@" 2>&1 | tr -d '\000' > "$out/logs/$name.log"
rc=${PIPESTATUS[0]}
echo "== $name: rc=$rc in $(( $(date +%s) - start )) s"
tail -n 6 "$out/logs/$name.log"
exit "$rc"

#!/bin/bash
# rank_counts.sh GPUS: the rank counts to run on a machine of GPUS GPUs: 2, 4, 8, ... below it,
# then GPUS itself (e.g. 8 -> "2 4 8", 2 -> "2").
gpus=$1 n=2 out=""
while [ "$n" -lt "$gpus" ]; do out="$out $n"; n=$((n * 2)); done
echo $out $gpus

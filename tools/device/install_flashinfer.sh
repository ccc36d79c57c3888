#!/bin/bash
# Device side, second FlashInfer call: joins the wheel staged by the first, installs it and its
# small deps into /tmp/site (next to the packages of ../shared/device/install.sh).
set -eu
here=$(dirname "$(readlink -f "$0")")
[ -f /tmp/stage_fi/part.aa ] || { echo "stage: /tmp/stage_fi/part.aa missing: redo the fi1 call" >&2; exit 3; }
[ -f /tmp/site/env.sh ] || { echo "stage: /tmp/site/env.sh missing: the machine went cold" >&2; exit 3; }
cat /tmp/stage_fi/part.aa "$here/part.ab" > "/tmp/stage_fi/$(cat "$here/big.name")"
cp "$here"/*.whl /tmp/stage_fi/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  /tmp/stage_fi/*.whl
echo "flashinfer installed into /tmp/site"

#!/usr/bin/env bash
# Build .aiperf-wheels/ in the repo root: what AIPerf 0.13.0 needs on the GPU machine (no network,
# Python 3.12, x86-64) beyond that machine's image, as cp312 wheels, plus install.sh to put them there.
#
# The list was found by running every scenario (bench/aiperf/run.py) with AIPerf on a Python 3.12
# environment holding only packages of the GPU machine's image (numpy, pandas, transformers,
# tokenizers, huggingface-hub, aiohttp, uvloop, rich, psutil, pyyaml, ...)
# plus the wheels below, adding each module that was missing until all nine scenarios ran and were
# valid; versions are those of a full `pip install aiperf==0.13.0` (bench/aiperf/setup.sh). The image
# lacks pydantic, pyzmq, orjson and msgspec; AIPerf imports ffmpeg-python (which imports future),
# crick, cyclopts, ruamel.yaml and pydantic-settings (python-dotenv) even for a text benchmark.
#
# A wheel that .device-wheels/ (bench/gpu/device-wheels.sh: Sanic and the vLLM client) already
# holds in the same version is not copied: wheels.txt names it there instead. Copy both folders there.
#
#   bash bench/aiperf/device-wheels.sh           # here, from the repo root; prints the folder's size
#   bash .aiperf-wheels/install.sh               # there: installs into /tmp/aiperf-site (AIPERF_SITE)
#   PYTHONPATH=/tmp/aiperf-site python3 -m aiperf profile ...
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${DEST:-.aiperf-wheels}
SHARED=.device-wheels
PY=${PYTHON:-python3}
mkdir -p "$DEST"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
  --platform any)
WANT=(aiperf==0.13.0 cyclopts==4.25.3 ruamel.yaml==0.18.17 pydantic-settings==2.16.3 python-dotenv==1.2.4
  crick==0.0.8 ffmpeg-python==0.2.0 future==1.0.0 pydantic==2.14.4 pydantic-core==2.50.5
  typing-inspection==0.4.5 annotated-types==0.8.0 orjson==3.11.9 msgspec==0.23.0 pyzmq==26.4.0)

# A wheel's file name starts with its project name, lower-cased with - and . as _, then -VERSION-.
stem() { local n=${1%%==*} v=${1##*==}; n=${n,,}; n=${n//-/_}; echo "${n//./_}-$v-"; }

: > "$DEST/wheels.txt"
for spec in "${WANT[@]}"; do
  s=$(stem "$spec")
  have=$(ls "$SHARED" 2> /dev/null | grep -i "^$s.*\.whl$" | head -n 1 || true)
  if [ -n "$have" ]; then
    echo "$SHARED/$have" >> "$DEST/wheels.txt"
    continue
  fi
  have=$(ls "$DEST" | grep -i "^$s.*\.whl$" | head -n 1 || true)
  if [ -z "$have" ]; then
    "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$DEST" "$spec" 2>&1 | grep -v '^WARNING' || true
    have=$(ls "$DEST" | grep -i "^$s.*\.whl$" | head -n 1 || true)
    [ -n "$have" ] || { echo "no cp312 x86-64 wheel for $spec" >&2; exit 1; }
  fi
  echo "$DEST/$have" >> "$DEST/wheels.txt"
done
# Drop wheels of earlier lists that are not wanted any more.
for f in "$DEST"/*.whl; do grep -qx "$f" "$DEST/wheels.txt" || rm -f "$f"; done

cat > "$DEST/install.sh" << 'INNER'
#!/usr/bin/env bash
# On the GPU machine, from the repo root: install AIPerf and what it needs beyond the image into
# $AIPERF_SITE (default /tmp/aiperf-site) for $PYTHON (default python3), then check that it starts.
# Run AIPerf as
#   PYTHONPATH=$AIPERF_SITE python3 -m aiperf ...
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=${AIPERF_SITE:-/tmp/aiperf-site}
PY=${PYTHON:-python3}
mapfile -t wheels < .aiperf-wheels/wheels.txt
for w in "${wheels[@]}"; do [ -f "$w" ] || { echo "missing $w (copy .aiperf-wheels and .device-wheels to the machine)" >&2; exit 1; }; done
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
PYTHONPATH=$SITE "$PY" -m aiperf --version
INNER
chmod +x "$DEST/install.sh"
echo "$(wc -l < "$DEST/wheels.txt") wheels listed in $DEST/wheels.txt:" >&2
cat "$DEST/wheels.txt" >&2
du -sh "$DEST"

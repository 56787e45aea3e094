#!/usr/bin/env bash
# Build .device-wheels/ in the repo root: what the H200 machine (no network, Python 3.12, x86-64) lacks
# beyond its image to serve ouro_fast and benchmark it, as cp312 wheels, plus install.sh to install them
# there:
#   - the server: Sanic, ujson and prometheus_client (pyproject.toml), with the dependencies pip resolves for
#     Python 3.12, and jsonschema and jiter (the openai SDK's chat streaming) for the structured-output tests
#     (xgrammar comes with the client's packages);
#   - the vLLM 0.33.0 benchmark client: the packages of bench/client-requirements.txt that the image
#     lacks (IMAGE below: the image holds torch, numpy, tokenizers, transformers, aiohttp, uvloop, ...),
#     and vLLM's own wheel without its compiled kernels, as vllm-<version>-py.tgz (the client is pure
#     Python, and the whole wheel would not fit a 64 MiB transfer).
# bench/aiperf/device-wheels.sh takes the wheels it shares with the client from here.
#
#   bash bench/gpu/device-wheels.sh                # here, from the repo root; prints the folder's size
#   eval "$(bash .device-wheels/install.sh)"       # there: installs into /tmp/site, exports PYTHONPATH
#   python3 -m vllm.entrypoints.cli.main bench serve ...
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${DEST:-.device-wheels}
PY=${PYTHON:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
SERVER=(sanic==25.12.1 ujson==6.1.0 prometheus_client==0.26.0 jsonschema==4.25.1 jiter==0.19.0)
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
  --platform any)
# Client packages that the H200 image already holds (its pip list): not carried.
IMAGE=" aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi charset-normalizer click
  cloudpickle einops frozenlist h11 huggingface-hub idna multidict numpy packaging pillow prometheus-client
  propcache psutil py-cpuinfo pyyaml regex requests safetensors tokenizers tqdm transformers urllib3 uvloop
  yarl "
mkdir -p "$DEST"

"$PY" -m pip download -q "${PLAT[@]}" -d "$DEST" "${SERVER[@]}"
client=()
while read -r spec; do
  name=${spec%%==*}
  case "$IMAGE" in *[[:space:]]"${name,,}"[[:space:]]*) continue ;; esac
  client+=("$spec")
done < <(grep -E '^[A-Za-z0-9]' bench/client-requirements.txt | grep -v '^vllm==')
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$DEST" "${client[@]}"

tgz="$DEST/vllm-$VLLM_VERSION-py.tgz"
if [ ! -f "$tgz" ]; then
  tmp=$(mktemp -d)
  "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$tmp" "vllm==$VLLM_VERSION"
  # The wheel's Python files, their data (JSON configs, chat templates) and its metadata, as a tree to
  # unpack into site-packages; not its compiled kernels, C/CUDA headers or binaries.
  "$PY" - "$tmp"/vllm-*.whl "$tgz" << 'PY'
import sys
import tarfile
import zipfile

KEEP = (".py", ".pyi", ".json", ".jinja", ".txt", "py.typed")
wheel, out = sys.argv[1:3]
with zipfile.ZipFile(wheel) as z, tarfile.open(out, "w:gz") as t:
    for info in z.infolist():
        meta = info.filename.split("/")[0].endswith(".dist-info")
        if info.is_dir() or not (meta or info.filename.endswith(KEEP)):
            continue
        member = tarfile.TarInfo(info.filename)
        member.size = info.file_size
        with z.open(info) as f:
            t.addfile(member, f)
PY
  rm -rf "$tmp"
fi

cat > "$DEST/install.sh" << 'INNER'
#!/usr/bin/env bash
# On the GPU machine: install the carried wheels, and vLLM's Python files if carried, into $SITE (default
# /tmp/site); print the line to eval: PYTHONPATH, and VLLM_TARGET_DEVICE=cpu, which only tells the vLLM
# client not to look for vLLM's CUDA kernels.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
SITE=${SITE:-/tmp/site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  "$here"/*.whl >&2
for t in "$here"/vllm-*-py.tgz; do
  if [ -f "$t" ]; then tar xzf "$t" -C "$SITE"; fi
done
echo "export PYTHONPATH=$SITE VLLM_TARGET_DEVICE=cpu"
INNER
chmod +x "$DEST/install.sh"
ls "$DEST" | grep -c '\.whl$' | sed 's/$/ wheels/' >&2
du -sh "$DEST"

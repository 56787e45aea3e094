#!/usr/bin/env bash
# Build vLLM 0.26.0 for the H200 machine (Python 3.12, torch 2.11, no network) as a bundle split in parts
# small enough to copy to the machine one at a time. vLLM 0.26.0 is the newest release built for torch 2.11.
#   bash bench/vllm/bundle.sh [OUT] [PARTS]      # OUT default .vllm-bundle (git-ignored), PARTS default 2
# OUT/p1 .. OUT/pN each hold one part; bench/gpu/matrix.sh stages them on the machine and unpacks.
# Needs pip access to PyPI here; about 85 MB of parts.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-.vllm-bundle}
PARTS=${2:-2}
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp)
for v in 39 35 34 31 28 27 26 24 17; do PLAT+=(--platform "manylinux_2_${v}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform any)
# What `vllm serve` imports that the H200 image lacks, at versions that work together with torch 2.11 and
# transformers 5.17 (the image's); compressed-tensors (and its loguru) for `--quantization fp8`.
DEPS=(fastapi==0.136.3 starlette==1.7.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.8.0
  typing-inspection==0.4.4 uvicorn==0.54.0 watchfiles==1.2.0 prometheus-fastapi-instrumentator==8.1.0
  openai==2.54.0 jiter==0.16.0 distro==1.9.0 sniffio==1.3.1 openai-harmony==0.0.8 cbor2==6.1.3 pyzmq==27.1.0
  msgspec==0.21.1 pybase64==1.4.3 cachetools==7.2.0 llguidance==1.7.6 xgrammar==0.2.7 apache-tvm-ffi==0.1.10
  partial-json-parser==0.2.1.1.post7 model-hosting-container-standards==0.1.16 jmespath==1.1.0
  setproctitle==1.3.7 compressed-tensors==0.17.0 loguru==0.7.3)
mkdir -p "$work/whl" "$work/site"
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$work/whl" vllm==0.26.0 "${DEPS[@]}"
# Unpack vLLM without what a dense bf16 model on FlashAttention 3 never loads (FA2, MoE and MLA kernels,
# deep_gemm for other Pythons, the Rust front end): the bundle would be too large to copy otherwise.
"$PY" - "$work/whl"/vllm-0.26.0-*.whl "$work/site" <<'PY'
import os, re, sys, zipfile
skip = re.compile(r"^vllm/(vllm_flash_attn/_vllm_fa2_C\.abi3\.so|_moe_C_stable_libtorch\.abi3\.so|vllm-rs"
                  r"|third_party/deep_gemm/_C\.cpython-31[01345]-x86_64-linux-gnu\.so|_flashmla(_extension)?_C\.abi3\.so)$")
with zipfile.ZipFile(sys.argv[1]) as z:
    for info in z.infolist():
        if not skip.match(info.filename):
            path = z.extract(info, sys.argv[2])
            if not info.is_dir():
                os.chmod(path, 0o755 if path.endswith(".so") else 0o644)
PY
rm "$work/whl"/vllm-0.26.0-*.whl
"$PY" -m pip install -q --no-deps --no-index --no-compile --target "$work/site" "${PLAT[@]}" "$work"/whl/*.whl
find "$work/site" -name __pycache__ -prune -exec rm -rf {} +
tar -C "$work" -cf - site | xz -T0 -6 > "$work/site.tar.xz"
(cd "$work" && split -n "$PARTS" -d -a 2 site.tar.xz part. && sha256sum site.tar.xz > SHA256SUMS)
rm -rf "$OUT"
for k in $(seq 1 "$PARTS"); do
  mkdir -p "$OUT/p$k"
  mv "$work/part.$(printf '%02d' $((k - 1)))" "$OUT/p$k/"
  cp "$work/SHA256SUMS" "$OUT/p$k/"
done
du -sh "$OUT"/p*

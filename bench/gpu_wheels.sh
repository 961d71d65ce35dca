#!/usr/bin/env bash
# What bench/gpu.py needs on a GPU machine that has torch and transformers but nothing of this
# project's: the project's own wheel and the wheels of its dependencies missing there (SQLAlchemy,
# greenlet, Alembic, Mako, orjson, watchfiles), for CPython 3.12 on manylinux x86_64, in .gpu/wheels;
# and the Qwen3 tokenizer in .gpu/qwen3. .gpu/ is ignored by git: carry it with the run.
#
#   bash bench/gpu_wheels.sh [SHARED_DIR]      # SHARED_DIR: default ../shared (tokenizers/qwen3)
#
# Then on the GPU machine, from the repository root (carry: .gpu):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/wheels/*.whl \
#     && export PYTHONPATH=/tmp/site; set -o pipefail;
#   PYTHONUNBUFFERED=1 python3 bench/gpu.py --tokenizer .gpu/qwen3 --out "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu.log"
# (--no-deps: everything else it needs is on the image, whatever versions it holds; --target: the
# image's Python is left as it is; bench/gpu.py imports this tree's hcapo_store first.)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
shared="${1:-$root/../shared}"
wheels="$root/.gpu/wheels"
rm -rf "$wheels" && mkdir -p "$wheels"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$wheels" \
  "SQLAlchemy>=2.0" greenlet "alembic>=1.16" Mako "orjson>=3.10" "watchfiles>=0.21"
python3 -m pip wheel -q --no-deps --no-build-isolation -w "$wheels" "$root"
rm -rf "$root/.gpu/qwen3"
cp -r "$shared/tokenizers/qwen3" "$root/.gpu/qwen3"
ls -l "$wheels"
du -sh "$root/.gpu"

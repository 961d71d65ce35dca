#!/usr/bin/env bash
# What bench/gpu.py and bench/gpu_gaps.py need on a GPU machine that has torch and transformers but
# nothing of this project's: the project's own wheel and the wheels of its dependencies missing there
# (SQLAlchemy, greenlet, Alembic, Mako, orjson, watchfiles), for CPython 3.12 on manylinux x86_64, in
# .gpu/wheels; and the Qwen3 tokenizer, packed as .gpu/qwen3.tar.gz (the scripts unpack it themselves).
# With --trl, what bench/gpu_trl.py needs besides: TRL and what it imports (accelerate, psutil,
# datasets, pyarrow, pandas, python-dateutil, six, dill, multiprocess, xxhash), pyarrow without its
# Flight and S3 libraries and pandas without its tests (TRL's step uses neither), so that .gpu stays
# under 60 MiB (the carry's limit is 64). .gpu/ is ignored by git: carry it with the run.
#
#   bash bench/gpu_wheels.sh [--trl] [SHARED_DIR]      # SHARED_DIR: default ../shared (tokenizers/qwen3)
#
# Then on the GPU machine, from the repository root (carry: .gpu):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
#     --target /tmp/hcapo/site-packages .gpu/wheels/*.whl && export PYTHONPATH=/tmp/hcapo/site-packages
#   set -o pipefail; PYTHONUNBUFFERED=1 python3 bench/gpu.py --out "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu.log"
# (--no-deps: everything else it needs is on the image, whatever versions it holds; --target: the
# image's Python is left as it is, in a folder named site-packages: dill, under datasets, pickles by
# value what lies elsewhere; the scripts import this tree's hcapo_store first.)
set -euo pipefail
trl=0
if [[ "${1:-}" == "--trl" ]]; then
  trl=1
  shift
fi
root="$(cd "$(dirname "$0")/.." && pwd)"
shared="${1:-$root/../shared}"
wheels="$root/.gpu/wheels"
rm -rf "$wheels" "$root/.gpu/qwen3" && mkdir -p "$wheels"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$1" "${@:2}"
}
download "$wheels" "SQLAlchemy>=2.0" greenlet "alembic>=1.16" Mako "orjson>=3.10" "watchfiles>=0.21"
python3 -m pip wheel -q --no-deps --no-build-isolation -w "$wheels" "$root"
if [[ $trl == 1 ]]; then
  # the versions tested with hcapo_store/training/trl_grpo.py (TRL_VERSIONS: 1.16)
  download "$wheels" "trl>=1.16,<1.17" "accelerate>=1.10" psutil "datasets>=4.7" python-dateutil six \
    "dill>=0.4.1,<0.4.2" "multiprocess>=0.70.19,<0.70.20" xxhash
  full="$(mktemp -d)"
  download "$full" "pyarrow>=24" "pandas>=2.1"
  python3 - "$full" "$wheels" <<'EOF'
"""Repack pyarrow without Flight, S3, headers and sources, pandas without its tests (RECORD too)."""
import re
import sys
import zipfile
from pathlib import Path

DROP = {
    "pyarrow": re.compile(r"^pyarrow/(include/|includes/|tests/|src/|.*flight|.*_s3|.*\.(pyx|pxd|pxi|h|cc)$)"),
    "pandas": re.compile(r"^pandas/tests/"),
}
for wheel in Path(sys.argv[1]).glob("*.whl"):
    drop = DROP[wheel.name.split("-")[0]]
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(Path(sys.argv[2]) / wheel.name, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if drop.search(info.filename):
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line + b"\n" for line in data.splitlines() if not drop.search(line.split(b",")[0].decode()))
            zout.writestr(info, data)
EOF
  rm -rf "$full"
fi
tar -czf "$root/.gpu/qwen3.tar.gz" -C "$shared/tokenizers" qwen3
ls -l "$wheels" "$root/.gpu"
du -sh "$root/.gpu"

#!/usr/bin/env bash
# FlashAttention-4 for a GPU host with no package index (the lent device machines: Python 3.12, torch 2.11+cu130,
# nothing reachable). `pip install 'regen[fa4]'` is the way on a host that has an index; this is for one that has not.
#
#   scripts/fa4_site.sh pack DIR            here: download the wheels (Python 3.12, x86_64) into DIR and split
#                                           them into DIR/part_* of 60 MiB, under a device call's 64 MiB carry
#   scripts/fa4_site.sh unpack WHEELS SITE  there: extract the wheels into SITE in the order that matters and
#                                           print the PYTHONPATH to export
#
# A call carries one part: the first call copies DIR/part_aa out of the work tree (cp .fa4/part_aa /tmp/), the
# second joins it with part_ab (cat /tmp/part_aa .fa4/part_ab | tar -x -C /tmp/fa4w) and unpacks.
# The set is whole only with nvidia-cutlass-dsl-libs-core (libs-base 4.8.1 needs it; it holds cutlass/cute),
# and libs-cu13 must land after libs-base: it overwrites base's files. Versions: flash-attn-4 4.0.0b40, the one
# regen's fa4 path was measured with (docs/training.md, issue 21).
set -euo pipefail

WHEELS=(
  flash-attn-4==4.0.0b40
  nvidia-cutlass-dsl==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1
  nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-cu13==4.8.1
  quack-kernels==0.6.5
  apache-tvm-ffi==0.1.15.post2
  torch-c-dlpack-ext==0.1.5
)

pack() {
  local out=$1 w
  mkdir -p "$out/wheels"
  for w in "${WHEELS[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$out/wheels" "$w"
  done
  # wheels are zip-compressed already: a plain tar, split, costs no CPU and barely any size
  tar -c -C "$out" wheels | split -b 60M - "$out/part_"
  ls -l "$out"/part_*
}

unpack() {
  local wheels=$1 site=$2
  [ -d "$wheels" ] || { echo "fa4_site: no wheel folder $wheels (join the parts first)" >&2; exit 2; }
  mkdir -p "$site"
  python3 - "$wheels" "$site" "${WHEELS[@]}" <<'EOF'
import pathlib, sys, zipfile
wheels, site, specs = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
for spec in specs:  # WHEELS' order: libs-cu13 after libs-base
    name, version = spec.split("==")
    stem = name.replace("-", "_") + "-" + version + "-"
    found = sorted(wheels.glob(stem + "*.whl"))
    if len(found) != 1:
        sys.exit(f"fa4_site: expected one wheel {stem}*.whl in {wheels}, found {len(found)}: pack again")
    zipfile.ZipFile(found[0]).extractall(site)
    print(f"fa4_site: {found[0].name}")
EOF
  # nvidia_cutlass_dsl's .pth is not read from a PYTHONPATH folder: its packages go on the path by hand
  echo "export PYTHONPATH=$site:$site/nvidia_cutlass_dsl/dsl_packages\${PYTHONPATH:+:\$PYTHONPATH}"
}

case "${1:-}" in
  pack) pack "${2:?pack DIR}" ;;
  unpack) unpack "${2:?unpack WHEELS SITE}" "${3:?unpack WHEELS SITE}" ;;
  *) echo "usage: $0 pack DIR | unpack WHEELS SITE" >&2; exit 2 ;;
esac

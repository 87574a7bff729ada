"""scripts/fa4_site.sh unpack: the FA4 wheels land in the order that matters, and a missing one is named."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "fa4_site.sh"
WHEELS = {  # the file names pip download gives these versions; a few bytes each, not the real packages
    "flash_attn_4-4.0.0b40-py3-none-any.whl": {"flash_attn/cute/__init__.py": "fa4"},
    "nvidia_cutlass_dsl-4.8.1-py3-none-any.whl": {"nvidia_cutlass_dsl_packages.pth": "pth"},
    "nvidia_cutlass_dsl_libs_core-4.8.1-py3-none-any.whl": {
        "nvidia_cutlass_dsl/dsl_packages/cutlass/cute/x.py": ""
    },
    "nvidia_cutlass_dsl_libs_base-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl": {
        "nvidia_cutlass_dsl/lib.so": "base"
    },
    "nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl": {
        "nvidia_cutlass_dsl/lib.so": "cu13"
    },
    "quack_kernels-0.6.5-py3-none-any.whl": {"quack/__init__.py": ""},
    "apache_tvm_ffi-0.1.15.post2-cp312-cp312-manylinux_2_28_x86_64.whl": {"tvm_ffi/__init__.py": ""},
    "torch_c_dlpack_ext-0.1.5-cp312-cp312-manylinux_2_28_x86_64.whl": {"torch_c_dlpack_ext/__init__.py": ""},
}


def _wheels(folder: Path, skip: str = "") -> None:
    folder.mkdir()
    for name, files in WHEELS.items():
        if skip and name.startswith(skip):
            continue
        with zipfile.ZipFile(folder / name, "w") as z:
            for path, text in files.items():
                z.writestr(path, text)


def test_unpack_lays_cu13_over_base_and_prints_the_path(tmp_path):
    _wheels(tmp_path / "w")
    res = subprocess.run(["bash", str(SCRIPT), "unpack", str(tmp_path / "w"), str(tmp_path / "site")],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stderr
    site = tmp_path / "site"
    # libs-cu13 overwrites libs-base's files: the other order leaves the CUDA 12 libraries behind
    assert (site / "nvidia_cutlass_dsl" / "lib.so").read_text() == "cu13"
    assert (site / "nvidia_cutlass_dsl" / "dsl_packages" / "cutlass" / "cute" / "x.py").exists()
    export = res.stdout.strip().splitlines()[-1]
    assert export.startswith(f"export PYTHONPATH={site}:{site}/nvidia_cutlass_dsl/dsl_packages")


def test_a_missing_wheel_is_named_and_nothing_is_half_said(tmp_path):
    _wheels(tmp_path / "w", skip="nvidia_cutlass_dsl_libs_core")
    res = subprocess.run(["bash", str(SCRIPT), "unpack", str(tmp_path / "w"), str(tmp_path / "site")],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode != 0
    assert "nvidia_cutlass_dsl_libs_core-4.8.1-*.whl" in res.stderr and "pack again" in res.stderr
    assert "export PYTHONPATH" not in res.stdout

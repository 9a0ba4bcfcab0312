"""passes/, codegen/ and runtime/ install inside the mambac namespace, editable and as a wheel."""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["mambac", "mambac.ops", "mambac.models", "mambac.convert", "mambac.passes", "mambac.codegen",
               "mambac.runtime"]
PROBE = ("import importlib, json, sys; mods = sys.argv[1:]; "
         "print(json.dumps({m: importlib.import_module(m).__file__ for m in mods}))")


def _where(env_path: str | None, cwd: Path) -> dict:
    env = dict(os.environ)
    if env_path:
        env["PYTHONPATH"] = env_path
    out = subprocess.run([sys.executable, "-c", PROBE, *SUBPACKAGES], cwd=cwd, env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_editable_install_maps_top_level_folders(tmp_path):
    files = _where(None, tmp_path)  # outside the repo: only the installed mapping can resolve these
    assert Path(files["mambac.passes"]).parent == ROOT / "passes"
    assert Path(files["mambac.codegen"]).parent == ROOT / "codegen"
    assert Path(files["mambac.runtime"]).parent == ROOT / "runtime"


def test_wheel_install_imports_every_subpackage(tmp_path):
    wheel_dir, site = tmp_path / "wheel", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheel_dir), str(ROOT)], check=True, capture_output=True, text=True)
    wheel = next(wheel_dir.glob("mambac-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "mambac/passes/fuse_ssm.py" in names and "mambac/runtime/compiled_module.py" in names
    assert not any(n.startswith(("passes/", "codegen/", "runtime/", "tests/")) for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "mambac = mambac.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True)
    files = _where(str(site), tmp_path)
    for mod in SUBPACKAGES:
        assert Path(files[mod]).is_relative_to(site), (mod, files[mod])

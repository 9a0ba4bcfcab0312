"""Setup for the generated-kernel tests.

* Triton decides at import time whether kernels run in its interpreter (its own helpers such as
  ``tl.cumsum`` are jitted then), so ``TRITON_INTERPRET=1`` is set here before anything imports
  Triton.  If another test module imported Triton first, tests marked ``interp`` are run once,
  together, in a subprocess with the variable set, and each such test reports that outcome.
* Until packaging maps ``codegen/`` to ``mambac.codegen`` everywhere, import it from the
  repository if the installed package lacks it.
* Generated kernels and autotune choices go to a per-session cache directory.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS_ENV = "MAMBAC_CODEGEN_INTERP_RESULTS"  # set in the subprocess: where to write outcomes

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
IN_PROCESS = os.environ.get("TRITON_INTERPRET") == "1"


def _ensure_codegen_importable() -> None:
    try:
        importlib.import_module("mambac.codegen")
        return
    except ModuleNotFoundError as exc:
        if exc.name != "mambac.codegen":
            raise
    import mambac
    spec = importlib.util.spec_from_file_location(
        "mambac.codegen", ROOT / "codegen" / "__init__.py",
        submodule_search_locations=[str(ROOT / "codegen")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["mambac.codegen"] = module
    spec.loader.exec_module(module)
    mambac.codegen = module


_ensure_codegen_importable()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "interp: runs generated kernels under the Triton interpreter")


@pytest.fixture(autouse=True)
def _gpu_tier(request, monkeypatch):
    """Tests marked ``gpu`` run on a CUDA device with the interpreter off, else skip; there they check
    correctness with each kernel's first GPU candidate instead of timing every candidate."""
    if request.node.get_closest_marker("gpu") is None:
        return
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs a CUDA device with the Triton interpreter off (GPU tier)")
    from mambac.codegen import autotune
    monkeypatch.setattr(autotune, "choose", lambda family, bucket, cands, bench: cands[0])


@pytest.fixture(autouse=True, scope="session")
def _kernel_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    from mambac import knobs
    with knobs.override(cache_dir=str(tmp_path_factory.mktemp("mambac-cache"))):
        yield


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """In the subprocess: record each interp test's outcome for the parent."""
    path = os.environ.get(RESULTS_ENV)
    if not path or not (report.when == "call" or report.failed):
        return
    with open(path, "a") as f:
        f.write(json.dumps({"nodeid": report.nodeid, "outcome": report.outcome,
                            "text": str(report.longrepr)[-4000:] if report.failed else ""}) + "\n")


_RESULTS: dict[str, dict] | None = None


def _subprocess_results() -> dict[str, dict]:
    global _RESULTS
    if _RESULTS is None:
        fd, path = tempfile.mkstemp(suffix=".jsonl")
        os.close(fd)
        env = dict(os.environ, TRITON_INTERPRET="1", **{RESULTS_ENV: path})
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "-m", "interp", str(ROOT / "tests" / "codegen")],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
        _RESULTS = {"__log__": {"text": proc.stdout[-4000:] + proc.stderr[-2000:]}}
        for line in Path(path).read_text().splitlines():
            rec = json.loads(line)
            if rec["outcome"] != "passed" or rec["nodeid"] not in _RESULTS:
                _RESULTS[rec["nodeid"]] = rec
        os.unlink(path)
    return _RESULTS


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    """Outside the interpreter, an interp test takes its outcome from the subprocess run."""
    if IN_PROCESS or os.environ.get(RESULTS_ENV) or pyfuncitem.get_closest_marker("interp") is None:
        return None
    results = _subprocess_results()
    rec = results.get(pyfuncitem.nodeid)
    if rec is None:
        pytest.fail(f"{pyfuncitem.nodeid} did not run in the interpreter subprocess:\n"
                    + results["__log__"]["text"])
    if rec["outcome"] != "passed":
        pytest.fail(f"failed under the Triton interpreter (subprocess):\n{rec['text']}")
    return True

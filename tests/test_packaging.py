"""What `pip install .` brings: every directly imported package is declared; a missing extra
(torch, pyarrow) is one line naming it; the private transformers helper is optional."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import types
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from _tokenizers import CHATML_WITH_BOS, bos_tokenizer, episode
from click.testing import CliRunner

from hcapo_store.cli import cli

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "cli.py", *(ROOT / "hcapo_store").rglob("*.py"), *(ROOT / "migrations").rglob("*.py")]
# Imported only behind an extra, each guarded by a MissingExtra (the tests below).
EXTRAS = {
    "torch": "local",
    "safetensors": "local",
    "pyarrow": "parquet",
    "psycopg": "postgres",
    "pandas": "pandas",
    "trl": "trl",
    "datasets": "trl",
    "verl": "verl",
    "transfer_queue": "verl",
}
# A module whose distribution is named otherwise, for when it is not installed here (TransferQueue's
# import name is transfer_queue)
DISTRIBUTIONS = {"transfer_queue": "transferqueue"}
# Run by a test in an environment it builds itself, not the test extra's (tests/test_verl.py: verl pins
# transformers<5.11).
OWN_VENV = {"_verl_driver.py", "_verl_tq_driver.py"}


def _imported_top_level_modules(sources: list[Path] = SOURCES) -> set[str]:
    """The third-party top-level modules ``sources`` import (anywhere: at module level, in
    functions, behind ``importorskip`` it is a call, so a test must import it plainly)."""
    local = {path.stem for path in sources}  # tests/_tokenizers.py, bench's own helpers, ...
    names = set()
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - local - {"hcapo_store", "cli", "__future__"}


def _undeclared(modules: set[str], declared: set[str]) -> list[str]:
    """Each module whose distribution (or, not installed, its own name) is not in ``declared``."""
    dists = packages_distributions()
    missing = []
    for module in sorted(modules):
        names = {d.lower().replace("_", "-") for d in dists.get(module, [DISTRIBUTIONS.get(module, module)])}
        if not names & declared:
            missing.append(f"{module} (distribution {sorted(names)})")
    return missing


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def _project() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _test_environment() -> set[str]:
    """What the README's test command installs: the dependencies and the ``test`` extra."""
    project = _project()
    return _requirement_names(project["dependencies"]) | _requirement_names(project["optional-dependencies"]["test"])


@pytest.mark.slow  # parses every module's imports; test_an_undeclared_import_in_a_test_is_caught stays fast
def test_every_imported_package_is_declared():
    project = _project()
    core = _requirement_names(project["dependencies"])
    extras = {k: _requirement_names(v) for k, v in project["optional-dependencies"].items()}
    missing = []
    for module in sorted(_imported_top_level_modules()):
        where = EXTRAS.get(module, "dependencies")
        declared = extras[where] if module in EXTRAS else core
        missing += [f"{m} in {where}" for m in _undeclared({module}, declared)]
    assert not missing, "imported but not declared in pyproject.toml: " + "; ".join(missing)
    assert {"jinja2", "huggingface-hub", "orjson"} <= core


@pytest.mark.parametrize("folder", ["tests", "bench"])
def test_what_tests_and_bench_import_is_in_the_test_extra(folder):
    """A fresh machine runs ``pip install -e '.[test]'`` and then the suite (bench/'s scripts
    run in tests/test_bench_scripts.py): every package they import must come with it, or
    collection fails there while a machine with the package installed by hand stays green."""
    sources = sorted(p for p in (ROOT / folder).rglob("*.py") if p.name not in OWN_VENV)
    missing = _undeclared(_imported_top_level_modules(sources), _test_environment())
    assert not missing, f"{folder}/ imports what neither dependencies nor the test extra declare: " + "; ".join(missing)


def test_an_undeclared_import_in_a_test_is_caught(tmp_path):
    """The check above can fail: a test file that imports a package nobody declares."""
    probe = tmp_path / "test_probe.py"
    probe.write_text("import numpy\nfrom scipy import stats\nimport not_a_declared_package.sub\n")
    sources = [*sorted(p for p in (ROOT / "tests").glob("*.py") if p.name not in OWN_VENV), probe]
    missing = _undeclared(_imported_top_level_modules(sources), _test_environment())
    assert [m.split(" ")[0] for m in missing] == ["not_a_declared_package"]


def _cli_without(module: str, *args: str) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh interpreter where ``import <module>`` fails, as if not installed."""
    code = f"import sys; sys.modules[{module!r}] = None; from hcapo_store.cli import cli; cli(prog_name='hcapo-store')"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )


@pytest.mark.parametrize(
    "command",
    [["serve-reference"], ["score", "--backend", "transformers"]],
    ids=["serve-reference", "score-transformers"],
)
def test_missing_torch_is_one_line_naming_the_extra(tmp_path, command):
    (tmp_path / "model").mkdir()
    r = _cli_without("torch", "--db", str(tmp_path / "x.db"), *command, "--model", str(tmp_path / "model"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "Error: a local model (score --model, serve-reference, demo) needs torch, which is not installed: "
        "pip install 'hcapo-store[local]'"
    ]


def test_missing_pyarrow_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    from test_credits import add_scorer, add_scores

    from hcapo_store.credits.compute import compute_credits
    from hcapo_store.ingestion.pipeline import ingest
    from hcapo_store.storage.store import Store

    db = tmp_path / "x.db"
    with Store.open(str(db)) as store:
        ingest(store, [ROOT / "examples" / "trajectories"])
        add_scorer(store, "s")
        add_scores(store, "s")
        compute_credits(store)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    out = tmp_path / "d.parquet"
    r = CliRunner().invoke(cli, ["--db", str(db), "export", "dataset", str(out), "--format", "parquet"])
    assert r.exit_code == 1
    assert r.output == (
        "Error: export --format parquet needs pyarrow, which is not installed: pip install 'hcapo-store[parquet]'\n"
    )
    assert not out.exists()


def test_prompts_render_without_the_private_transformers_helper(tmp_path, monkeypatch):
    from transformers.utils import chat_template_utils

    from hcapo_store.rendering.prompts import PromptBuilder

    messages, outcome, steps = episode(3)
    # A template of its own (a comment makes it unique): transformers caches compiled templates.
    template = CHATML_WITH_BOS + "{# packaging test #}"
    with_helper = PromptBuilder(bos_tokenizer(tmp_path / "a", template=template)).build_episode(
        messages, outcome, steps
    )
    compiled = chat_template_utils._compile_jinja_template(template)
    assert not vars(compiled.environment).keys() & {"is_safe_attribute", "getattr", "call"}  # ours: own sandbox

    # A transformers without the helper: importing it fails, transformers itself still renders.
    template = CHATML_WITH_BOS + "{# packaging test, no helper #}"
    monkeypatch.setitem(sys.modules, chat_template_utils.__name__, types.ModuleType(chat_template_utils.__name__))
    without = PromptBuilder(bos_tokenizer(tmp_path / "b", template=template)).build_episode(messages, outcome, steps)
    assert without == with_helper  # the same prompts, token for token
    compiled = chat_template_utils._compile_jinja_template(template)
    assert "is_safe_attribute" not in vars(compiled.environment)  # rendered unpatched

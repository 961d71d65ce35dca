"""The package's public surface is derived from its contents, and every name in it works."""

import importlib
import inspect
import subprocess
import sys

import hcapo_store


def test_all_is_exactly_the_public_names():
    public = {n for n in dir(hcapo_store) if not n.startswith("_")}
    # submodules imported by using the API appear as attributes too; they are not the API
    public -= {n for n in public if inspect.ismodule(getattr(hcapo_store, n))}
    public -= {"annotations", "import_module", "TYPE_CHECKING", "Any"}
    assert set(hcapo_store.__all__) == public


def test_every_public_name_resolves_to_a_documented_object_of_this_package():
    for name in hcapo_store.__all__:
        obj = getattr(hcapo_store, name)
        assert obj.__module__.startswith("hcapo_store."), name
        assert obj.__name__ == name
        assert inspect.getdoc(obj), f"{name} has no docstring"


def test_the_whole_job_is_public():
    for name in (
        "Store",
        "ingest",
        "prepare",
        "run_scoring",
        "compute_credits",
        "export_dataset",
        "export_hindsight_json",
        "write_report",
    ):
        assert name in hcapo_store.__all__


def test_unknown_name_is_an_attribute_error():
    try:
        hcapo_store.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_import_is_light():
    """``import hcapo_store`` must not pull the heavy stack (start-up of every command)."""
    code = (
        "import sys, hcapo_store; heavy = [m for m in ('sqlalchemy', 'alembic', 'numpy', 'transformers', "
        "'torch', 'httpx') if m in sys.modules]; print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_python_dash_m_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "hcapo_store", "--help"], capture_output=True, text=True, check=True)
    assert "Usage:" in out.stdout and "ingest" in out.stdout
    assert importlib.util.find_spec("hcapo_store.__main__") is not None


def test_the_online_loop_and_the_trainer_handoff_are_public():
    """The README's online section used deep paths for these (issue 35 item 7)."""
    from hcapo_store.online.follow import follow
    from hcapo_store.scoring.live import score_live
    from hcapo_store.training import adapters
    from hcapo_store.training.handoff import Handoff

    assert hcapo_store.follow is follow and hcapo_store.score_live is score_live
    assert hcapo_store.Handoff is Handoff
    for name in ("verl_advantages", "slime_advantages", "slime_advantage_function", "prime_rl_advantages"):
        assert getattr(hcapo_store, name) is getattr(adapters, name)


def test_provisional_modules_are_named_and_kept_out_of_the_surface():
    """The trainer integrations track TRL's and verl's private hooks: provisional, deep path only."""
    provisional = hcapo_store._PROVISIONAL
    assert provisional
    doc = hcapo_store.__doc__ or ""
    assert "Provisional" in doc
    for module in provisional:
        assert importlib.util.find_spec(module) is not None, module
        assert module.rsplit(".", 1)[-1] in doc, f"{module} is not named provisional in the package docstring"
        exported_from = {m for m in hcapo_store._EXPORTS.values()}
        assert module not in exported_from, module

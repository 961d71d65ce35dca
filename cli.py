"""hcapo-store's command line, kept at the top of the repository (the project's layout).

The commands live in the package (``hcapo_store/cli/``) so that the installed wheel and
``python -m hcapo_store`` never depend on a top-level module named ``cli``; this file
only lets ``python cli.py ...`` run from a checkout.
"""

from hcapo_store.cli import cli

if __name__ == "__main__":
    cli(prog_name="hcapo-store")

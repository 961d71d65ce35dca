"""``python -m hcapo_store``: the same command line as ``hcapo-store``.

It imports the package's own CLI (``hcapo_store.cli``), never a top-level ``cli`` module,
so whatever ``cli.py`` the current directory holds is not what runs.
"""

from hcapo_store.cli import cli

if __name__ == "__main__":
    cli(prog_name="hcapo-store")

"""``python -m hcapo_store``: the same command line as ``hcapo-store``."""

from cli import cli

if __name__ == "__main__":
    cli(prog_name="hcapo-store")

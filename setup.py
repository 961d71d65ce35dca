"""Package discovery: every package under ``hcapo_store/`` plus the top-level ``migrations/``
(Alembic's layout, kept where the project asks for it), installed as ``hcapo_store.migrations``
so a wheel finds its migrations the way a checkout does. Everything else is in pyproject.toml;
pyproject.toml alone cannot combine discovered packages with a renamed folder."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["hcapo_store", "hcapo_store.*"])
    + [f"hcapo_store.{name}" for name in find_packages(include=["migrations", "migrations.*"])],
    package_dir={"hcapo_store.migrations": "migrations"},
)

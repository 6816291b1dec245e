"""Packaging: one import namespace, `pagedserve`, over the top-level folders (package-dir
mapping; the same for the editable install and the wheel). Metadata and package data are in
pyproject.toml."""

from setuptools import find_namespace_packages, setup

ROOTS = ("server", "handlers", "engine", "kernels")
packages = [
    f"pagedserve.{name}"
    for name in find_namespace_packages(include=[*ROOTS, *(f"{root}.*" for root in ROOTS)], exclude=["*.__pycache__"])
]

setup(
    packages=packages,
    package_dir={f"pagedserve.{root}": root for root in ROOTS},
)

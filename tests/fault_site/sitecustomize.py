"""Installs the tests' fault injection (tests/faults.py) in every Python process started with this
folder on PYTHONPATH: Python imports `sitecustomize` at start-up, before any module runs, so the
fault reaches torchrun's workers and their restarts without the product naming it. Tests put the
folder there with `tests.faults.fault_env`, only while `US_INJECT_FAULT` is set."""

from tests.faults import install_from_env

install_from_env()

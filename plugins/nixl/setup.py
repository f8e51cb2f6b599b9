"""Builds the nixl backend's post path in C (kvt_nixl/_fastpath.c: the CPython API only, no NIXL
headers); everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvt_nixl._fastpath", ["kvt_nixl/_fastpath.c"], extra_compile_args=["-O2"])])

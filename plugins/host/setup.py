"""Builds the host backend's same-host post in C (kvt_host/_fastpath.c: the CPython API only); everything
else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvt_host._fastpath", ["kvt_host/_fastpath.c"], extra_compile_args=["-O2"])])

"""Builds kvt's native copy engine (kvt/_copy.c) and post path (kvt/_fastpath.c); everything else is in
pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvt._copy", ["kvt/_copy.c"], extra_compile_args=["-O2", "-pthread"],
                             extra_link_args=["-pthread"]),
                   Extension("kvt._fastpath", ["kvt/_fastpath.c"], extra_compile_args=["-O2"])])

"""Builds kvt_ucx._ucp against the UCX that the libucx wheel ships (found
through the package, never a fixed path).  The build requirement pins the
same libucx release that ucxx-cu12 installs, so headers and library agree."""

import os

import libucx
from setuptools import Extension, setup

ucx = os.path.dirname(libucx.__file__)

setup(ext_modules=[Extension(
    "kvt_ucx._ucp", ["kvt_ucx/_ucp.c"],
    include_dirs=[os.path.join(ucx, "include")],
    library_dirs=[os.path.join(ucx, "lib")],
    libraries=["ucp", "ucs"],
    # libucp is found at run time because kvt_ucx.native calls
    # libucx.load_library() before importing the extension
    extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wno-missing-field-initializers"],
)])

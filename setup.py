"""The native parts of the build, which pyproject.toml cannot declare without an experimental
setuptools feature: the codec's accelerator (kproxy/protocol/_accel.c) and the relay lane
(kproxy/server/_lane.c, which imports the accelerator's check engine). Both are optional: without a C
compiler or the Python headers the build warns and kproxy installs and runs in pure Python (see
kproxy/protocol/compiler.py and kproxy/server/lane.py)."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("kproxy.protocol._accel", ["kproxy/protocol/_accel.c"], optional=True),
    Extension("kproxy.server._lane", ["kproxy/server/_lane.c"], optional=True),
])

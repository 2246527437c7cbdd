"""The codec's native accelerator, kproxy/protocol/_accel.c: the one part of the build that
pyproject.toml cannot declare without an experimental setuptools feature. Everything else about the
package is in pyproject.toml. The extension is optional: without a C compiler or the Python headers
the build warns and kproxy installs and runs in pure Python (see kproxy/protocol/compiler.py)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kproxy.protocol._accel", ["kproxy/protocol/_accel.c"], optional=True)])

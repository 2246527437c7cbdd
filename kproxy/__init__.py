"""kproxy: a transparent Kafka wire-protocol proxy.

``__version__`` is the package's one version: pyproject.toml reads it (setuptools' dynamic version),
and the command line, the start-up log and the spans' instrumentation scope import it from here.
"""

__version__ = "0.1.0"

"""kproxy: a transparent Kafka wire-protocol proxy."""

__version__ = "0.1.0"

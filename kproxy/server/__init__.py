"""The trio layer: listeners, per-connection pumps, TLS, discovery, drain, the demo and embedding.

The only part of kproxy that does I/O; it drives the sans-I/O sessions of ``kproxy.proxy``.
"""

"""Telemetry: Prometheus metrics, OpenTelemetry spans and the traffic log, all fed from the one
completed-request entry per request. Nothing here imports trio; the admin HTTP listener that serves
the metrics lives in ``kproxy.server.admin``.
"""

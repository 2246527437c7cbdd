"""Identity at the edge, sans-I/O: the SASL exchanges kproxy completes itself (termination) and the
checks behind them (SCRAM, PLAIN, JWT). Every function takes bytes, keys and the time, and returns a
verdict; fetching a JWKS or a token, reading files and sleeping belong to ``kproxy.server``.
"""

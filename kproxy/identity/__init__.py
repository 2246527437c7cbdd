"""Identity at the edge, sans-I/O: the SASL exchanges kproxy completes itself (termination) and the
checks behind them (SCRAM, PLAIN, JWT, Kerberos names and Kafka's principal.to.local rules; the
GSS-API acceptor itself is handed in by ``kproxy.server.kerberos``), the principal of a verified client certificate, and the PROXY
header a load balancer sends. Every function takes bytes, keys and the time, and returns a verdict;
fetching a JWKS or a token, reading files, sockets and sleeping belong to ``kproxy.server``.
"""

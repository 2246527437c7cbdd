"""Record encryption's I/O half: clients of the key management services that hold the KEKs
(``vault``: Vault and OpenBao Transit; ``aws``: AWS KMS; ``hsm``: a PKCS#11 token; ``local``: a key
file, for development only), behind one
small interface (``client``), their settings (``settings``), and the service that fills the pure
DEK ring and cache from them for the connections (``service``). The envelope and the key
lifetimes are ``kproxy.envelope``'s.
"""

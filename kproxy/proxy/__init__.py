"""kproxy's per-connection proxy logic, sans-I/O: sessions, filters, address rewriting, replies.

Bytes and decoded messages in, actions out; nothing here touches sockets, clocks or trio.
"""

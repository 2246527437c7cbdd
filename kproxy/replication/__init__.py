"""What kproxy knows of replicated clusters, without I/O: MirrorMaker 2's offset-sync and checkpoint
records, translating a group's offsets from one cluster to its replica, and the state file that keeps
a virtual cluster's active cluster across restarts.

Pure like ``kproxy.protocol``: bytes and numbers in, decisions out; ``kproxy.server.clusters`` and
``kproxy.server.replicas`` do the reading and writing."""

"""Operating kproxy: the Grafana dashboard built as code (``dashboard``), ``kproxy top``, a live
terminal view of one proxy from its admin listener (``top``), and ``kproxy switch``, which moves a
virtual cluster to another upstream cluster through it (``switch``)."""

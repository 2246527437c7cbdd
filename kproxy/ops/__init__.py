"""Operating kproxy: the Grafana dashboard built as code (``dashboard``) and ``kproxy top``, a live
terminal view of one proxy from its admin listener (``top``)."""

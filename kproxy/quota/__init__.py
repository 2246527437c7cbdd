"""Client quotas: Kafka-style throttling of produce bytes, fetch bytes, requests and request time.

``rate`` measures rates over sliding sample windows and computes Kafka's throttle time, ``budgets``
keeps the usage per quota and key across reloads, and ``engine`` holds the filter that charges
requests and throttles clients. The quotas themselves are written in the rule files.
"""

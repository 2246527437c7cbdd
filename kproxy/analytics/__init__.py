"""``kproxy report``: the PySpark pipeline over kproxy's traffic log (fleet report, upgrade risk,
quota advice, end-to-end latency).

Only ``kproxy report`` imports this package, lazily, so the proxy itself never needs PySpark or Java.
The modules that do not touch Spark (``removed_versions``, ``quota_file``, ``synthetic``) import
without it; everything else imports ``pyspark`` at the top.
"""

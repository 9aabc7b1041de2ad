"""Load tests against the SLA in benchmark_config.yaml: locust users (``locustfile``), a bounded run
with its verdict (``make loadtest``) and the batch size / delay / workers / concurrency sweep with
its report (``make sweep``)."""

"""Observability tooling: metrics.yaml from the handler's metric specs (``make metrics-config``), the
Grafana dashboard (``make dashboard``) and the Kubernetes PrometheusRule (``make prometheus-rule``)
generated from code and rule files, a local Prometheus with the project's rules, and the dashboard's
panels rendered from a loaded server (``make dashboard-png``)."""

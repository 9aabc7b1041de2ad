"""The suite: ``unit/`` (pure logic and the shipped files), ``integration/`` (a real TorchServe with
the real archive, a real Prometheus, locust, gRPC), ``harness/`` (what they share)."""

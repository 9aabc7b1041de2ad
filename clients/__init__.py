"""Clients of the server's APIs a user runs: the gRPC client (Predictions and StreamPredictions)
over the project's own ``inference.proto``, a subset of TorchServe's."""

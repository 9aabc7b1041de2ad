"""The code inside the archive: ``sd_handler.py`` adapts TorchServe to plain modules (request
protocol, service, step engine, families, scheduling, pipeline loading, encoding, metrics) that know
nothing of TorchServe. Packaged as the ``handler`` package at the archive's root."""

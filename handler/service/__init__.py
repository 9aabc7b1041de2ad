"""One service for both TorchServe batching modes: admission (``admission``: decode, validate and
start jobs), stepping (``stepping``: time limits, one forward, progress), finishing
(``finishing``: decode and answer), the answers every request gets (``answers``), and the two
loops over one iteration (``loops``: ``DiffusionService``, ``build_service``)."""

"""The code inside the archive, in rooms by concern; imports run down this list, never back up:

- the worker at the top: ``sd_handler`` (TorchServe's adapter, the one module that imports ``ts``),
  ``service/`` (admission, stepping, finishing: the two batching loops over one iteration),
  ``control`` and ``single_worker`` (what the server process signals), ``metrics``, ``config``;
- ``api/``: wire formats, validation, the native and OpenAI APIs, input images, encoding;
- ``engine/``: the step engine, the scheduling of forwards, loading a pipeline into an engine;
- ``adapters/``: what a row carries besides its prompt (LoRAs, ControlNets), served from
  directories of named entries;
- ``families/``: what differs between model families, behind one contract.

Packaged as the ``handler`` package at the archive's root (docs/architecture.md)."""

"""The step engine: jobs (``jobs``) started, stepped in shared denoiser forwards and decoded
(``step_engine``), which jobs share the next forward (``scheduling``), and a diffusers pipeline
loaded and optimized into an engine (``loading``). Asks the family (``handler.families``) for
whatever differs between models, and the adapters (``handler.adapters``) for each row's extras."""

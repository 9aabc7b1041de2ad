"""Benchmarks, every one printing ratios measured side by side in one run: pipeline variants
(``make bench-pipeline``), the step engine against diffusers (``make bench-engine``), serving
overhead (``make bench-overhead``), continuous against dynamic batching
(``make bench-continuous``) and real sizes on a GPU (``make bench-gpu``); with the random-weight
SD 1.5 and SDXL architectures and diffusers' own call as the reference."""

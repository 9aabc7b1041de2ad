"""Single-file checkpoints as A1111, ComfyUI and Civitai keep them: their headers read safely
(``files``), what they are detected from names and shapes (``detect``), the shipped architectures'
configs (``configs/``) and tokenizers (``tokenizers``, ``assets/``), and the pipeline built from
one (``single_file``)."""

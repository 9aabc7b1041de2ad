"""What a row of a denoiser forward carries besides its prompt: LoRA adapters (``loras``, applied
per row by ``lora_rows`` or, in a compiled denoiser, ``lora_slots``) and ControlNets
(``controlnets``), each served from a directory of named entries (``library``: names checked
before a file is touched, loaded on first use, least recently used evicted)."""

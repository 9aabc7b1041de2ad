"""Making models: tiny random-weight pipelines of every family (``make model``), the default model
trained here on shapes and colours (``make train-default-model``) and its prompt x seed grid
through TorchServe (``make model-grid``)."""

"""Training of V4.1 models and of the default model (beside bench/: it may import dsv41_jax and checkpoints;
nothing but bench/ and tests imports it). `training.objective`: f32 masters, the quantization-aware view, the loss
and the optax step; `training.train_default`: the corpus, the trainer and its evaluation."""

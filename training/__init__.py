"""Training of V4.1 models (beside bench/: it may import dsv41_jax and checkpoints; nothing but bench/ and tests
imports it). `training.objective`: f32 masters, the quantization-aware view, the loss and the optax step."""

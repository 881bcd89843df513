"""Training the default model: the QAT objective, the corpus, the trainer (imported by bench/ and tests/ only)."""

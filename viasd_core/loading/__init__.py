"""Getting models in: local folders, GGUF, the hub, the catalog of pairs, draft models, calibration profiles, prompt sets, synthetic models."""

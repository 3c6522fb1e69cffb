"""Helpers the tests share: tiny model files, engine factories, cases (not tests)."""

"""Training drafts for a target: distilled draft models and EAGLE-3 feature heads."""

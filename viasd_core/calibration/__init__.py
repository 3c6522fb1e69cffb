"""Calibration: the slim verifier's search and the tiers' thresholds for a quality budget."""

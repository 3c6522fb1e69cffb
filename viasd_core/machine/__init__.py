"""What viasd decides about the machine it runs on: one file per decision and the profile that names
them and resolves them in order (profile.py); their records and the machine's identity (record.py)."""

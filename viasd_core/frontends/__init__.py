"""The ways a person drives a session: chat, doctor, streaming output."""

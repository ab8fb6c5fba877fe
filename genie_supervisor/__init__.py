"""genie-supervisor: the arbiter daemon for home voice-assistant boxes."""

__version__ = "0.1.0"

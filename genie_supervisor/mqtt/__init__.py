"""Home Assistant over MQTT: discovery, live state, controls and voice hints (see docs/mqtt.md)."""

from .bridge import MqttBridge
from .commands import CommandError, MqttCommands
from .entities import Topics

__all__ = ["CommandError", "MqttBridge", "MqttCommands", "Topics"]

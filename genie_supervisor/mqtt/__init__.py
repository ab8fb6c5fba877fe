"""Home Assistant over MQTT: discovery, live state, controls and voice hints (see docs/mqtt.md)."""

from ..errors import CommandError
from .bridge import MqttBridge
from .commands import MqttCommands
from .entity_model import Topics

__all__ = ["CommandError", "MqttBridge", "MqttCommands", "Topics"]

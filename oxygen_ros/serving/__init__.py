"""Serving the engine to robots over openpi's policy-server protocol (websocket + msgpack)."""

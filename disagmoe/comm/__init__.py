"""Transports: point-to-point tensor messages between ranks behind one interface (base.py)."""

"""The engine-facing contract: keys, transfer specs, events and the manager interface.

Nothing here imports torch or any lower layer; everything else builds on it.
"""
